-- The Postgres projection (issue 14): one row per account (the cursor, the balance, the
-- highest client sequence of this service's own batches) and the recent-writes index beside
-- it. Both tables are written together, in one statement, by whoever moves the cursor.

CREATE TABLE IF NOT EXISTS tally_accounts (
    account_id            uuid PRIMARY KEY,
    balance_cents         bigint NOT NULL,
    -- The stream cursor: the last version folded. Only ever raised.
    version               bigint NOT NULL,
    max_client_seq        bigint NOT NULL,
    -- The commit time (epoch ms of the store's clock) of the newest batch a catch-up folded
    -- into this row. A replica that reads the row raises its estimate of the server's now
    -- to it, as if it had read that batch itself. Only real commit times go here, never a
    -- replica's estimate: one replica's fast clock must not shorten the fleet's window.
    server_ts_ms          bigint NOT NULL DEFAULT 0,
    -- Set when the stream cannot be folded past `version` (poisoned, or trimmed above it).
    -- Sticky, so every replica answers the account the same.
    broken_version        bigint,
    broken_reason         text,
    trimmed_min_available bigint
);

-- One row per (account, event id): the response that event produced. `expires_at_ms` is in
-- the store's server time (epoch ms of the store's commit clock), never a replica's or the
-- database's clock.
CREATE TABLE IF NOT EXISTS tally_recent_writes (
    account_id    uuid     NOT NULL,
    event_id      uuid     NOT NULL,
    balance_cents bigint   NOT NULL,
    version       bigint   NOT NULL,
    -- The event, the fingerprint a reused key is checked against: its type major (1
    -- Deposited, 2 Withdrawn, 3 TransferredOut, 4 TransferredIn), amount, counterparty.
    event_kind    smallint NOT NULL,
    amount_cents  bigint   NOT NULL,
    counterparty  uuid,
    expires_at_ms bigint   NOT NULL,
    PRIMARY KEY (account_id, event_id)
);

-- The sweep deletes by expiry, oldest first, a bounded batch at a time.
CREATE INDEX IF NOT EXISTS tally_recent_writes_expiry ON tally_recent_writes (expires_at_ms);

-- Keys kept for the retention. An index row now lives until its key is forgotten:
-- `expires_at_ms` is the landing (server time) plus the retention, and the sweep deletes by
-- it as before. `window_ends_ms` is the landing plus the window: until then the row is part
-- of an account's recent writes, which a replica may copy into memory (`warm.rs`).
--
-- NULL in `window_ends_ms` is a row written before this column: its `expires_at_ms` was the
-- end of its window, so it is both. Old replicas in a rolling upgrade write such rows, and
-- sweep and look up by `expires_at_ms`, so they keep every newer row for its retention too.
ALTER TABLE tally_recent_writes ADD COLUMN IF NOT EXISTS window_ends_ms bigint;

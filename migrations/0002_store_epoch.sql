-- The store the shared rows were folded from (session 12): the store's epoch, a random id the
-- first replica to find none writes to the store once (`src/projection/regress.rs`). A
-- replica whose store shows another epoch is on a store that was replaced under these rows,
-- and serves none of them until an operator reconciles (README, "A store that went
-- backwards"); deleting this row with the others is part of that.

CREATE TABLE IF NOT EXISTS tally_store_epoch (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    epoch uuid NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

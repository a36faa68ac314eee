-- wrk: 1-cent deposits to one account, each with an Idempotency-Key of its own.
--   wrk -t1 -c64 -d1800s -s scripts/bench-keys.lua URL -- ACCOUNT [ANSWERS] [DELAY_MS] [PREFIX]
-- ANSWERS (0: no limit) ends wrk after that many answers, so a run leaves about that many
-- keys (use one thread: the first to reach it ends the process, and wrk prints no summary).
-- DELAY_MS pauses each connection between requests (a paced writer). PREFIX names the keys
-- (PREFIX-THREAD-N, N from 1), so a later retry can name one; by default it is the run's start
-- time, so runs differ and a later run writes instead of replaying.
local next_id = 0

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
end

function init(args)
  account = args[1]
  limit = tonumber(args[2] or "0")
  pause = tonumber(args[3] or "0")
  counter = 0
  answered = 0
  prefix = args[4] or ("keys-" .. os.time())
  headers = { ["Content-Type"] = "application/json" }
  body = '{"amountCents":1}'
  path = "/api/accounts/" .. account .. "/deposit"
end

function request()
  counter = counter + 1
  headers["Idempotency-Key"] = string.format("%s-%d-%d", prefix, thread_id, counter)
  return wrk.format("POST", path, headers, body)
end

function delay()
  return pause
end

function response(status, headers, body)
  answered = answered + 1
  if limit > 0 and answered >= limit then
    -- wrk's own stop waits out -d; ending the process is the only way to stop at a count.
    os.exit(0)
  end
end

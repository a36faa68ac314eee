-- wrk: one deposit per request, each with an Idempotency-Key of its own.
--   wrk -t2 -c64 -d10s -s scripts/bench/dep.lua http://127.0.0.1:8080 -- spread
-- `spread` deposits to 1,000 accounts in turn, `hot` to the 3 demo accounts.
local next_id = 0

function setup(thread)
  thread:set("thread_id", next_id)
  next_id = next_id + 1
end

function init(args)
  mode = args[1] or "spread"
  counter = 0
  -- keys differ from one run to the next, so a run against a replica that saw an earlier
  -- one writes instead of replaying
  run_id = os.time()
  accounts = {}
  if mode == "hot" then
    -- Alice, Bob and Charlie (UUIDv5 of the name, docs/api.md)
    accounts = {
      "6128e305-7e13-5ce6-ba25-6a4b44cc9f0e",
      "3da2fa7e-cf4d-55a1-ae0e-bad709d0de52",
      "1e344e71-e1fd-5788-930d-b09cdeec5bed",
    }
  else
    for i = 1, 1000 do
      accounts[i] = string.format("00000000-0000-4000-8000-%012d", i)
    end
  end
  headers = { ["Content-Type"] = "application/json" }
  body = '{"amountCents":1}'
end

function request()
  counter = counter + 1
  local account = accounts[(counter + thread_id * 7) % #accounts + 1]
  headers["Idempotency-Key"] = string.format("wrk-%d-%d-%d", run_id, thread_id, counter)
  return wrk.format("POST", "/api/accounts/" .. account .. "/deposit", headers, body)
end

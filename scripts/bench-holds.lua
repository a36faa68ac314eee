-- wrk: holds placed and posted in pairs, or deposits, on the same accounts; and quota
-- modes that fill a replica with funds and expiring holds (scripts/bench-holds.sh runs them).
--   wrk -t2 -c64 -d10s -s scripts/bench-holds.lua http://127.0.0.1:8080 -- MODE [ACCOUNTS] [QUOTA] [EXPIRES] [FIRST]
-- Always two threads (-t2): each takes its half of the accounts and of the quota.
-- MODE:
--   pairs     place a 1-cent hold, then post it once its 201 is back (two writes a pair)
--   deposits  one 1-cent deposit a request
--   fund      QUOTA deposits of 1,000,000 cents in all, one an account in turn
--   fill      QUOTA 1-cent holds in all, expiring in EXPIRES seconds, accounts in turn
-- Past its QUOTA a thread asks only GET /healthz: the caller stops wrk once the replica's
-- metrics count the writes.
-- ACCOUNTS (default 1000) are fixed ids from FIRST (default 1): one is the hot account.
-- Keys differ run to run.
-- Every answer must be 2xx: wrk counts any other as "Non-2xx".
local threads = {}

function setup(thread)
  thread:set("thread_id", #threads)
  table.insert(threads, thread)
end

function init(args)
  mode = args[1] or "pairs"
  local n = tonumber(args[2] or "1000")
  quota = tonumber(args[3] or "0")
  expires = tonumber(args[4] or "60")
  local first = tonumber(args[5] or "1")
  threads_total = 2
  accounts = {}
  for i = 1, n do
    accounts[i] = string.format("00000000-0000-4000-8000-%012d", first + i - 1)
  end
  run_id = os.time()
  counter = 0
  posts = 0
  placed = {}
  headers = { ["Content-Type"] = "application/json" }
end

local function key(kind)
  counter = counter + 1
  headers["Idempotency-Key"] = string.format("%s-%d-%d-%d", kind, run_id, thread_id, counter)
end

-- The thread's share of the accounts, in turn: thread t takes accounts t+1, t+1+T, ...
local function account_in_turn()
  local i = (counter * threads_total + thread_id) % #accounts + 1
  return accounts[i]
end

function request()
  if mode == "pairs" and #placed > 0 then
    local hold = table.remove(placed)
    key("post")
    return wrk.format("POST", "/api/accounts/" .. hold[1] .. "/holds/" .. hold[2] .. "/post", headers, "{}")
  end
  -- this thread's share of the quota: the shares add up to it exactly. Before the run wrk
  -- asks thread 0's script for one request to check it, and never sends it.
  local share = math.floor((quota - thread_id + threads_total - 1) / threads_total)
  if thread_id == 0 then
    share = share + 1
  end
  if quota > 0 and counter >= share then
    return wrk.format("GET", "/healthz")
  end
  key(mode)
  local account = account_in_turn()
  if mode == "deposits" then
    return wrk.format("POST", "/api/accounts/" .. account .. "/deposit", headers, '{"amountCents":1}')
  elseif mode == "fund" then
    return wrk.format("POST", "/api/accounts/" .. account .. "/deposit", headers, '{"amountCents":1000000}')
  elseif mode == "fill" then
    local body = string.format('{"amountCents":1,"expiresInSecs":%d}', expires)
    return wrk.format("POST", "/api/accounts/" .. account .. "/holds", headers, body)
  end
  return wrk.format("POST", "/api/accounts/" .. account .. "/holds", headers, '{"amountCents":1}')
end

function response(status, headers, body)
  if status == 201 and mode == "pairs" then
    local account = string.match(body, '"accountId":"([%x-]+)"')
    local hold = string.match(body, '"holdId":"([%x-]+)"')
    table.insert(placed, { account, hold })
  elseif status == 200 and mode == "pairs" then
    posts = posts + 1
  end
end

-- Runs in wrk's main state, where init never ran: only the threads' own counts are known.
function done(summary, latency, requests)
  local seconds = summary.duration / 1e6
  local total = 0
  for _, t in ipairs(threads) do
    total = total + (t:get("posts") or 0)
  end
  if total > 0 then
    io.write(string.format("pairs %d in %.1f s: %.0f pairs/s\n", total, seconds, total / seconds))
  end
end

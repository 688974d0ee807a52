"""Fair scheduling across tenants in Redis: the scripts that queue, pick and requeue jobs.

The rule is :mod:`service.fair_queue`'s (start-time fair queueing in samples, weighted by
``Quotas.weight``), kept in Redis so that every worker process and api replica shares it (keys
in :mod:`service.keys`): each tenant's queue is a list of ``"<n> <job id>"``
(``tenant_queue``), the tenants with jobs queued are a sorted set scored by their pass
(``fair_active``), and the virtual time, idle tenants' passes and weights sit beside it.

Delivery keeps the consumer group's guarantees: every queued job also has a *ticket* in the one
job stream (``job_stream``). :data:`PICK_LUA` reads a ticket (``XREADGROUP``) for each job it
takes, in the same script that pops the fair tenant's next job, and records which job the ticket
now stands for (``job_tickets``). The ticket stays pending in the group until the job's end
script acknowledges it, and a dead worker's tickets are taken over with ``XAUTOCLAIM``, their
jobs looked up in ``job_tickets``; every delivery counts an attempt, as before. The group's lag
is thus the number of jobs queued and not yet taken: the figure an autoscaler reads.

The scripts compute the keys of the tenant they choose from the key for an empty name (each
tenant's keys end with its name); psgrad runs on one Redis, not a cluster.
"""

from __future__ import annotations

__all__ = ["PICK_LUA", "RETRY_LUA", "SUBMIT_LUA", "UNCOUNT"]

# Queue an element "<n> <job id>" for a tenant (push: RPUSH at the end, LPUSH to retry first);
# a tenant whose queue was empty starts at the virtual time, or its own pass if that is larger.
_ENQUEUE = """
local function enqueue(queue, active, passes, vtime, tenant, element, push)
  if not redis.call('ZSCORE', active, tenant) then
    local v = tonumber(redis.call('GET', vtime)) or 0
    local p = tonumber(redis.call('HGET', passes, tenant)) or 0
    redis.call('ZADD', active, math.max(v, p), tenant)
  end
  redis.call(push, queue, element)
end
"""

# A job that ends (or is canceled) leaves its tenant's count of jobs queued or running: the
# state's tenant (none: a job from before tenants, never counted) and the key for an empty name.
UNCOUNT = """
local function uncount(state, tenant_jobs, job_id)
  local tenant = redis.call('HGET', state, 'tenant')
  if tenant then
    local n = redis.call('HGET', state, 'n') or '1'
    redis.call('ZREM', tenant_jobs .. tenant, n .. ' ' .. job_id)
  end
end
"""

# KEYS: stream, state, payload, tenant queue, active, passes, weights, vtime, tenant jobs, rate.
# ARGV: max depth, ttl, payload ('': stored in the answers' Redis), id, n, enqueued_at, deadline,
# tenant, weight, concurrent jobs quota, queued samples quota, requests/s quota (each 0: none),
# bucket size.
# Returns {'ok'}, {'depth'}, or the quota refused with what the tenant holds ({'concurrent_jobs',
# jobs}, {'queued_samples', samples}) or how long until a token ({'requests_per_s', seconds}).
# The token is spent last: a refused request costs none.
SUBMIT_LUA = _ENQUEUE + """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return {'depth'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local n, ttl = tonumber(ARGV[5]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now)  -- jobs whose state expired unended
local max_jobs, max_samples = tonumber(ARGV[10]), tonumber(ARGV[11])
if max_jobs > 0 or max_samples > 0 then
  local live = redis.call('ZRANGE', KEYS[9], 0, -1)
  if max_jobs > 0 and #live >= max_jobs then return {'concurrent_jobs', #live} end
  if max_samples > 0 then
    local held = 0
    for _, m in ipairs(live) do held = held + tonumber(string.match(m, '^(%d+) ')) end
    if held + n > max_samples then return {'queued_samples', held} end
  end
end
local rate = tonumber(ARGV[12])
if rate > 0 then
  local burst = tonumber(ARGV[13])
  local b = redis.call('HMGET', KEYS[10], 'tokens', 'at')
  local tokens = tonumber(b[1]) or burst
  tokens = math.min(burst, tokens + math.max(0, now - (tonumber(b[2]) or now)) * rate)
  if tokens < 1 then return {'requests_per_s', tostring((1 - tokens) / rate)} end
  redis.call('HSET', KEYS[10], 'tokens', tostring(tokens - 1), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[10], math.ceil(burst / rate) + 1)
end
if ARGV[3] ~= '' then redis.call('SET', KEYS[3], ARGV[3], 'EX', ttl) end
redis.call('HSET', KEYS[2], 'status', 'queued', 'enqueued_at', ARGV[6], 'deadline', ARGV[7],
           'attempts', '0', 'n', ARGV[5], 'tenant', ARGV[8])
redis.call('EXPIRE', KEYS[2], ttl)
local element = ARGV[5] .. ' ' .. ARGV[4]
redis.call('ZADD', KEYS[9], now + ttl, element)
if redis.call('TTL', KEYS[9]) < ttl then redis.call('EXPIRE', KEYS[9], ttl) end
redis.call('HSET', KEYS[7], ARGV[8], ARGV[9])
enqueue(KEYS[4], KEYS[5], KEYS[6], KEYS[8], ARGV[8], element, 'RPUSH')
redis.call('XADD', KEYS[1], '*', 't', ARGV[8])
return {'ok'}
"""

# KEYS: stream, active, passes, weights, vtime, tickets.
# ARGV: group, consumer, tenant queue key for an empty name, max jobs, room (samples), first
# ('1': the first job is taken whatever its size).
# Takes jobs in fair order while they fit, each with a ticket; returns {last entry id of the
# stream, full ('1': the next job did not fit), ticket id, "<n> <job id>", ...}. A ticket of an
# older api ({id, n}: the job itself) is taken as its job; a ticket with no job queued (lost
# with Redis data) is dropped, a queued job with no ticket gets a new one.
PICK_LUA = """
local out = {}
local left, room, first = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local full = '0'
local function ticket()
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1,
                         'STREAMS', KEYS[1], '>')
  if not got then return nil end
  local entry = got[1][2][1]
  local f = {}
  for i = 1, #entry[2], 2 do f[entry[2][i]] = entry[2][i + 1] end
  return entry[1], f
end
local function take(eid, element, n)
  redis.call('HSET', KEYS[6], eid, element)
  out[#out + 1] = eid
  out[#out + 1] = element
  room, left, first = room - n, left - 1, false
end
while left > 0 do
  local top = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #top == 0 then
    local eid, f = ticket()
    if not eid then break end
    if f['id'] then
      take(eid, (f['n'] or '1') .. ' ' .. f['id'], tonumber(f['n']) or 1)
    else
      redis.call('XACK', KEYS[1], ARGV[1], eid)
      redis.call('XDEL', KEYS[1], eid)
    end
  else
    local tenant, pass = top[1], tonumber(top[2])
    local queue = ARGV[3] .. tenant
    local head = redis.call('LINDEX', queue, 0)
    if not head then
      redis.call('ZREM', KEYS[2], tenant)
    else
      local n = tonumber(string.match(head, '^(%d+) '))
      if n > room and not first then
        full = '1'
        break
      end
      local eid, f = ticket()
      if not eid then
        redis.call('XADD', KEYS[1], '*', 't', tenant)
        eid, f = ticket()
      end
      if f['id'] then
        take(eid, (f['n'] or '1') .. ' ' .. f['id'], tonumber(f['n']) or 1)
      else
        redis.call('LPOP', queue)
        redis.call('SET', KEYS[5], tostring(pass))
        pass = pass + n / (tonumber(redis.call('HGET', KEYS[4], tenant)) or 1)
        if redis.call('LLEN', queue) == 0 then
          redis.call('ZREM', KEYS[2], tenant)
          redis.call('HSET', KEYS[3], tenant, tostring(pass))
        else
          redis.call('ZADD', KEYS[2], pass, tenant)
        end
        take(eid, head, n)
      end
    end
  end
end
local last = '0-0'
if #out == 0 then
  local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #newest > 0 then last = newest[1][1] end
end
table.insert(out, 1, full)
table.insert(out, 1, last)
return out
"""

# KEYS: state, stream, tickets, active, passes, vtime.
# ARGV: group, old ticket id, last error json, job id, tenant queue key for an empty name, the
# tenant of a job stored without one, the delivery's attempt ('' for jobs read but not counted).
# A job to deliver again goes first in its tenant's queue with a new ticket; the old ticket is
# acknowledged. A job that ended meanwhile (canceled) is only acknowledged. A stale delivery (a
# later attempt counted: its job taken over) changes nothing: queued again, the job would be
# done twice, and the ticket its new owner holds would be deleted.
RETRY_LUA = _ENQUEUE + """
local st = redis.call('HGET', KEYS[1], 'status')
if ARGV[7] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[7] then return st end
if st == 'queued' or st == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'queued')
  if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[3]) end
  local tenant = redis.call('HGET', KEYS[1], 'tenant') or ARGV[6]
  local element = (redis.call('HGET', KEYS[1], 'n') or '1') .. ' ' .. ARGV[4]
  enqueue(ARGV[5] .. tenant, KEYS[4], KEYS[5], KEYS[6], tenant, element, 'LPUSH')
  redis.call('XADD', KEYS[2], '*', 't', tenant)
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
return st
"""

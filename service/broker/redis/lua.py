"""Every Lua script of the Redis broker, each with the keys and arguments it takes.

Each script changes a job's state and what goes with it in one step: the api side's
(:data:`SUBMIT_LUA`, :data:`CANCEL_LUA`) and the worker side's (:data:`PICK_LUA`,
:data:`RETRY_LUA`, :data:`START_LUA`, :data:`PLANNING_LUA`, :data:`ATTEMPT_LUA`,
:data:`BEGIN_LUA`, :data:`FINISH_LUA`). Key names are :mod:`service.broker.redis.keyspace`'s.
Only small values pass through them (ids, statuses, errors, numbers, and an answer of at most
:data:`~service.broker.redis.keyspace.ANSWER_INLINE_BYTES`, written whole by the end script in
the same round trip); larger answers travel as stream pieces (:mod:`service.broker.redis.writer`).

Fair scheduling across tenants: the rule is :mod:`service.broker.fair_queue`'s (start-time fair
queueing in samples, weighted by ``Quotas.weight``), kept in Redis so that every worker process
and api replica shares it: each tenant's queue is a list of ``"<n> <job id>"``
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

__all__ = ["ATTEMPT_LUA", "BEGIN_LUA", "CANCEL_LUA", "FINISH_LUA", "PICK_LUA", "PLANNING_LUA",
           "RETRY_LUA", "START_LUA", "SUBMIT_LUA"]

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
# bucket size, digest ('': none; a keyed job's request digest).
# Returns {'ok'}, {'depth'}, {'held', digest} (a keyed job whose state exists: nothing queued),
# or the quota refused with what the tenant holds ({'concurrent_jobs', jobs}, {'queued_samples',
# samples}) or how long until a token ({'requests_per_s', seconds}). The token is spent last:
# a refused request costs none.
SUBMIT_LUA = _ENQUEUE + """
if ARGV[14] ~= '' and redis.call('EXISTS', KEYS[2]) == 1 then
  return {'held', redis.call('HGET', KEYS[2], 'digest') or ''}
end
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
if ARGV[14] ~= '' then redis.call('HSET', KEYS[2], 'digest', ARGV[14]) end
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


# --- the worker's job ends ---

# KEYS: state, answer, notify, stream, payload, tickets.
# ARGV: group, entry id, status, attempt, error json, finished_at, result ttl, notify ttl,
# inline answer, job id, tenant jobs key for an empty name (the job leaves its tenant's count).
# (The retry script is RETRY_LUA, above.)
# 'succeeded' comes after the answer's last piece, and only from the delivery that owns the job
# (its attempt is the state's latest): it names that attempt as the whole answer. A small answer
# comes inline (a non-empty last argument): the whole file is written here as the 'head' entry,
# in place of whatever an earlier attempt left, so one round trip answers and ends the job. A
# stale delivery (its job taken over: a later attempt counted) neither ends nor acknowledges the
# job, whatever its status (a worker cut off, then back, must not fail the job its new owner is
# answering): the owner does. Attempt 0: ends decided as the job is read (poison, expired).
# Returns 1 where it ended the job, -1 for a stale delivery (a later attempt counted, the job
# ended by it or not), 0 where the job ended otherwise meanwhile (canceled, deleted, expired).
FINISH_LUA = UNCOUNT + """
local st = redis.call('HGET', KEYS[1], 'status')
local stored = 0
local attempts = redis.call('HGET', KEYS[1], 'attempts')
if ARGV[4] ~= '0' and attempts and attempts ~= ARGV[4] then
  stored = -1
end
if st == 'queued' or st == 'running' then
  if stored == -1 then
    return -1
  end
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_at', ARGV[6])
  redis.call('HDEL', KEYS[1], 'planning_since')
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
  if ARGV[3] == 'succeeded' then
    if ARGV[9] ~= '' then
      redis.call('DEL', KEYS[2])
      redis.call('XADD', KEYS[2], '*', 'a', ARGV[4], 'k', 'head', 'd', ARGV[9])
    end
    redis.call('HSET', KEYS[1], 'answer', ARGV[4])
    redis.call('XADD', KEYS[2], '*', 'a', ARGV[4], 'k', 'end')
    redis.call('EXPIRE', KEYS[2], ARGV[7])
  else
    redis.call('DEL', KEYS[2])
  end
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('DEL', KEYS[5])
  uncount(KEYS[1], ARGV[11], ARGV[10])
  redis.call('RPUSH', KEYS[3], 'done')
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  stored = 1
elseif st ~= 'succeeded' then
  redis.call('DEL', KEYS[2])
end
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[4], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[4], ARGV[2])
  redis.call('HDEL', KEYS[6], ARGV[2])
end
return stored
"""

# KEYS: state. ARGV: started_at, worker. A delivery again drops the planning its earlier
# worker began (that worker died: it plans no more).
START_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'queued' or st == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
  redis.call('HDEL', KEYS[1], 'planning_since')
end
return st
"""

# KEYS: state. ARGV: since (epoch seconds; '' once planning ended), seconds spent.
# A running job's worker plans (since) or has planned: the api's wait does not count that time,
# and the state outlives its deadline by as much. Nothing for a job ended or gone.
PLANNING_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], 'planning_since', ARGV[1])
  return 1
end
redis.call('HDEL', KEYS[1], 'planning_since')
redis.call('HINCRBYFLOAT', KEYS[1], 'planned_s', ARGV[2])
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl + math.ceil(tonumber(ARGV[2]))) end
return 1
"""

# KEYS: state. Counts a delivery only of a job that still exists (no key without a TTL);
# returns the count and the state hash after it (field, value, field, value, ...).
ATTEMPT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, {}} end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
return {n, redis.call('HGETALL', KEYS[1])}
"""


# --- the api's cancel ---

# KEYS: state, notify, payload, answer. ARGV: finished_at, result ttl, notify ttl, tenant jobs
# key for an empty name, job id. A queued job stays in its tenant's queue: the worker that
# takes it finds it canceled and only acknowledges it.
CANCEL_LUA = UNCOUNT + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return false end
if st == 'queued' or st == 'running' then
  uncount(KEYS[1], ARGV[4], ARGV[5])
  redis.call('HSET', KEYS[1], 'status', 'canceled', 'finished_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('DEL', KEYS[3], KEYS[4])
  redis.call('RPUSH', KEYS[2], 'done')
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return st
"""


# KEYS: state, answer, notify. ARGV: tenant jobs key for an empty name, job id. The api's
# forget of a job whose answer it relayed: a job not yet ended (a client that hung up while
# the worker wrote its answer) leaves its tenant's count too, whose ZREM no end runs after.
FORGET_LUA = UNCOUNT + """
uncount(KEYS[1], ARGV[1], ARGV[2])
return redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
"""


# --- an answer's header (the writer's) ---

# KEYS: state, answer, notify. ARGV: attempt, header bytes, ttl. Only the delivery that owns an
# unfinished job starts its answer (a stale one, its job taken over or ended, writes nothing).
BEGIN_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'running' and st ~= 'queued' then return 0 end
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
redis.call('XADD', KEYS[2], '*', 'a', ARGV[1], 'k', 'head', 'd', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('RPUSH', KEYS[3], 'answer')
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
"""

"""The worker side's Lua scripts: each changes a job's state and its stream entry together.

Only small values pass through them (ids, statuses, errors, numbers, and an answer of at most
:data:`service.keys.ANSWER_INLINE_BYTES`, written whole by the end script in the
same round trip); larger answers travel as stream pieces (:mod:`service.broker.redis_answer`).
"""

from __future__ import annotations

from service.broker.redis_fair import UNCOUNT

__all__ = ["ATTEMPT_LUA", "FINISH_LUA", "PLANNING_LUA", "START_LUA"]

# KEYS: state, answer, notify, stream, payload, tickets.
# ARGV: group, entry id, status, attempt, error json, finished_at, result ttl, notify ttl,
# inline answer, job id, tenant jobs key for an empty name (the job leaves its tenant's count).
# (The retry script is the fair scheduler's: service/broker/redis_fair.py.)
# 'succeeded' comes after the answer's last piece, and only from the delivery that owns the job
# (its attempt is the state's latest): it names that attempt as the whole answer. A small answer
# comes inline (a non-empty last argument): the whole file is written here as the 'head' entry,
# in place of whatever an earlier attempt left, so one round trip answers and ends the job. A
# stale delivery (its job taken over: a later attempt counted) neither ends nor acknowledges the
# job, whatever its status (a worker cut off, then back, must not fail the job its new owner is
# answering): the owner does. Attempt 0: ends decided as the job is read (poison, expired).
FINISH_LUA = UNCOUNT + """
local st = redis.call('HGET', KEYS[1], 'status')
local stored = 0
if st == 'queued' or st == 'running' then
  if ARGV[4] ~= '0' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[4] then
    return 0
  end
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_at', ARGV[6])
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

# KEYS: state. ARGV: started_at, worker
START_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'queued' or st == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
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

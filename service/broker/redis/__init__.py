"""The Redis broker: a stream with a consumer group for jobs, keys with TTLs for everything else.

Life of a job (key names in :mod:`service.broker.redis.keyspace`)::

    api  submit   the tenant's quotas checked, SET payload (safetensors) + HSET state {queued,
                  deadline, tenant, ...} + RPUSH tenant queue + XADD a ticket to the stream (one
                  Lua script, refused while the stream holds PSGRAD_MAX_QUEUE_DEPTH jobs); with
                  an answers' Redis the payload is SET there first, out of the queue's
                  append-only file (the script then sets the rest)
    worker take   one Lua script pops jobs in fair order across tenants, each with a ticket read
                  by XREADGROUP (:data:`~service.broker.redis.lua.PICK_LUA`; XREAD BLOCK
                  while there is none), and XAUTOCLAIM of tickets idle past the visibility
                  timeout (their worker died); HINCRBY attempts; poison, expired, canceled: ended
    worker start  one pipeline per batch marks its jobs running and learns which were canceled
    worker answer XADD the answer's header to its stream (RPUSH notify: the api relays the
                  bytes as they land) and its bytes in pieces to the attempt's pieces stream,
                  in the answers' Redis if one is configured (:mod:`service.broker.redis.writer`)
    worker done   one Lua script: HSET state {succeeded (naming the whole attempt)|failed},
                  RPUSH notify, then XACK + XDEL, so a job is acknowledged only once its answer is
                  whole and only the delivery that owns the job can mark it succeeded; an answer
                  of at most 64 KiB is written whole by this script (one round trip in all)
    api  wait     BLPOP notify (the api never polls), then read the state and the answer (a
                  small answer is whole in its first entry: one round trip reads both)

The two sides, each in modules of its own (the worker side imports nothing of the api's):

- api (asyncio): :mod:`~service.broker.redis.api` (:class:`RedisBroker`) and
  :mod:`~service.broker.redis.reader` (an answer relayed as its pieces land);
- worker (synchronous, in worker processes): :mod:`~service.broker.redis.worker`
  (:class:`RedisJobSource`), :mod:`~service.broker.redis.intake` (taking jobs and the batching
  window) and :mod:`~service.broker.redis.writer` (an answer written in pieces);
- both: :mod:`~service.broker.redis.keyspace` (every key of the queue, its jobs and its
  workers), :mod:`~service.broker.redis.lua` (every script, with the keys it takes) and
  :mod:`~service.broker.redis.common` (replies read as text, limits, failures, framing).
"""

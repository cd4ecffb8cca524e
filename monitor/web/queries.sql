-- Named read queries of the web console (`fleet web`) on the Postgres back-end, besides the
-- dashboards' (monitor/dashboards/queries.sql). Format: "-- name: <name>" then a one-line
-- description, then the statement. Each has its REST twin in monitor/web/reads.py (RestSnapshot):
-- the same view or table, the same filters and order.

-- name: review_queue
-- Completed tasks waiting for review, oldest first.
select * from fleet.review_queue order by since, id;

-- name: batch_overview
-- Batches, newest first, at most %(limit)s.
select * from fleet.batch_overview order by id desc limit %(limit)s;

-- name: batch_get
-- One batch with its members and gates (fleet.batch_get: an unknown or other lane's batch is LF003).
select fleet.batch_get(%(id)s) as batch;

-- name: find_tasks
-- Tasks, newest first, filtered by lane, state, key (exact) and text (in the key or the title).
select * from fleet.tasks
 where (%(lane)s::text is null or lane = %(lane)s)
   and (%(state)s::text is null or state = %(state)s)
   and (%(key)s::text is null or key = %(key)s)
   and (%(text)s::text is null or key ilike '%%' || %(text)s || '%%' or title ilike '%%' || %(text)s || '%%')
 order by id desc
 limit %(limit)s;

-- name: task
-- One task.
select * from fleet.tasks where id = %(id)s;

-- name: task_runs
-- The runs of one task, oldest first.
select * from fleet.runs where task_id = %(id)s order by id;

-- name: task_events
-- The journal of one task, newest first, at most %(limit)s.
select * from fleet.journal where task_id = %(id)s order by id desc limit %(limit)s;

-- name: session
-- One session (where a run's shift runs: its host).
select * from fleet.session_overview where session_id = %(id)s;

-- name: throttles_since
-- Throttles (usage limits an agent hit) from %(since)s on, newest first, at most %(limit)s.
select * from fleet.events where kind = 'throttled' and ts >= %(since)s::timestamptz
 order by id desc limit %(limit)s;

-- name: stalled_tasks
-- Running tasks past their lane's stall_seconds, or waiting on a question (fleet.stalled_tasks).
select * from fleet.stalled_tasks();

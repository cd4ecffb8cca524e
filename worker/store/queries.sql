-- Named read queries (the few statements Python sends besides the SQL API calls).
-- Format: "-- name: <name>" then a one-line description, then the statement.

-- name: task_by_id
-- One task by id.
select * from fleet.tasks where id = %(id)s;

-- name: task_by_key
-- One task by its idempotency key.
select * from fleet.tasks where key = %(key)s;

-- name: list_tasks
-- Tasks, newest first, optionally filtered by lane and state.
select * from fleet.tasks
 where (%(lane)s::text is null or lane = %(lane)s)
   and (%(state)s::text is null or state = %(state)s)
 order by id desc
 limit %(limit)s;

-- name: task_events
-- The journal of one task, oldest first.
select * from fleet.events where task_id = %(id)s order by id;

-- name: task_runs
-- The runs (attempts) of one task, oldest first.
select * from fleet.runs where task_id = %(id)s order by id;

-- name: last_lane_handoff
-- The newest lane hand-off snapshot of a lane.
select * from fleet.lane_handoffs where lane = %(lane)s order by id desc limit 1;

-- name: list_lanes
-- Every lane row.
select * from fleet.lanes order by name;

-- name: lane_counts
-- Tasks per lane and state.
select lane, state, count(*) as n from fleet.tasks group by lane, state order by lane, state;

-- name: active_sessions_on_host
-- Active sessions of one host, for the monitor's pid checks.
select id, lane, pid, pid_started_at from fleet.sessions where state = 'active' and host = %(host)s;

-- name: lane_summary
-- Per lane: tasks by state, retries, hand-offs, and the tokens and cost of every run.
select l.name as lane,
       count(t.id) filter (where t.state = 'queued') as queued,
       count(t.id) filter (where t.state = 'running') as running,
       count(t.id) filter (where t.state = 'done') as done,
       count(t.id) filter (where t.state = 'dead') as dead,
       count(t.id) filter (where t.state = 'cancelled') as cancelled,
       coalesce(sum(t.failures + t.evaporations), 0) as retries,
       coalesce(sum(t.handoffs), 0) as handoffs,
       coalesce((select sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens)
                   from fleet.runs r where r.lane = l.name), 0) as tokens,
       coalesce((select sum(r.cost_usd) from fleet.runs r where r.lane = l.name), 0) as cost_usd
  from fleet.lanes l
  left join fleet.tasks t on t.lane = l.name
 group by l.name
 order by l.name;

-- name: ready_by_lane
-- Ready tasks per lane (what a launcher needs to decide whether a shift has work).
select lane, count(*) as ready from fleet.tasks where state = 'queued' and run_at <= now() group by lane;

-- name: open_tasks_with_prefix
-- Tasks whose key starts with a prefix and that are not finished.
select count(*) as n from fleet.tasks where key like %(prefix)s || '%%' and state in ('queued', 'running');

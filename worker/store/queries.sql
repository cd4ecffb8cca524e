-- Named read queries (the few statements Python sends besides the SQL API calls).
-- Format: "-- name: <name>" then a one-line description, then the statement.

-- name: task_by_id
-- One task by id.
select * from fleet.tasks where id = %(id)s;

-- name: task_by_key
-- The tasks of an idempotency key (keys are per lane: one task per lane at most), oldest first.
select * from fleet.tasks where key = %(key)s order by id;

-- name: list_tasks
-- Tasks, newest first, optionally filtered by lane and state.
select * from fleet.tasks
 where (%(lane)s::text is null or lane = %(lane)s)
   and (%(state)s::text is null or state = %(state)s)
 order by id desc
 limit %(limit)s;

-- name: task_events
-- The journal of one task, oldest first (fleet.journal: the events and what the rows record).
select * from fleet.journal where task_id = %(id)s order by id;

-- name: task_runs
-- The runs (attempts) of one task, oldest first.
select * from fleet.runs where task_id = %(id)s order by id;

-- name: last_lane_handoff
-- The newest lane hand-off snapshot of a lane.
select * from fleet.lane_handoffs where lane = %(lane)s order by id desc limit 1;

-- name: list_lanes
-- Every lane row.
select * from fleet.lanes order by name;

-- name: list_pools
-- Every capacity pool: its slots, and its throttle (until, note, who set it).
select name, slots, throttled_until, throttle_note, throttled_by from fleet.pools order by name;

-- name: lane_counts
-- Tasks per lane and state.
select lane, state, count(*) as n from fleet.tasks group by lane, state order by lane, state;

-- name: active_sessions_on_host
-- Active sessions of one host, for the monitor's pid checks.
select id, lane, pid, pid_started_at, pid_identity from fleet.sessions where state = 'active' and host = %(host)s;

-- name: lane_summary
-- Per lane: tasks in every state, retries, hand-offs, and the tokens and cost of every run
-- (defined once, as fleet.lane_summary(), which the REST store calls too).
select * from fleet.lane_summary();

-- name: ready_by_lane
-- Ready tasks per lane (what a launcher needs to decide whether a shift has work; fleet.ready_by_lane()).
select * from fleet.ready_by_lane();

-- name: states_with_prefix
-- Tasks whose key starts with a prefix, counted by state (every state that has one).
select state, count(*) as n from fleet.tasks where key like %(prefix)s || '%%' group by state;

-- name: summary_with_prefix
-- lane_summary of the tasks whose key starts with a prefix and of their runs, per lane that has any
-- (fleet.lane_summary(prefix): `fleet up --demo`'s own run).
select * from fleet.lane_summary(%(prefix)s);

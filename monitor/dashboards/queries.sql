-- Named read queries of the dashboards (`fleet status`, `stats`, `snapshot`, `report`).
-- Format: "-- name: <name>" then a one-line description, then the statement.
-- They read the views of migrations/*_fleet_views.sql, or, for the report's charts, a time
-- window of the tables through the same indexes. Parameters are psycopg's %(name)s.

-- name: lane_overview
-- The lane overview, optionally one lane.
select * from fleet.lane_overview
 where (%(lane)s::text is null or lane = %(lane)s)
 order by lane;

-- name: stuck_tasks
-- Running tasks that look stuck, with the reasons.
select * from fleet.stuck_tasks
 where (%(lane)s::text is null or lane = %(lane)s)
 order by stage_started_at, task_id;

-- name: blocked_tasks
-- Tasks waiting for an operator (fleet resume / fleet retry), oldest first.
select * from fleet.blocked_tasks
 where (%(lane)s::text is null or lane = %(lane)s)
 order by blocked_at, id;

-- name: attention_tasks
-- Running agents waiting on a question or a permission prompt.
select * from fleet.attention_tasks
 where (%(lane)s::text is null or lane = %(lane)s)
 order by attention_at, id;

-- name: pool_overview
-- Capacity pools: slots, in use, throttled until, throttles, provider errors and spill-overs today.
select * from fleet.pool_overview order by pool;

-- name: pool_windows
-- The usage windows of the pools: budget, used, how full, reset, provider's figure or estimate.
select * from fleet.pool_windows order by pool, window_name;

-- name: window_outcomes
-- Per pool since a moment: throttles avoided by the windows, throttles hit, spill-overs, window hand-offs.
select * from fleet.window_outcomes(%(since)s::timestamptz, now() + interval '1 second');

-- name: active_sessions
-- Active sessions, newest first.
select * from fleet.session_overview
 where state = 'active' and (%(lane)s::text is null or lane = %(lane)s)
 order by started_at desc;

-- name: sessions
-- Active sessions and those started in the last 24 h.
select * from fleet.session_overview
 where (%(lane)s::text is null or lane = %(lane)s)
 order by state = 'active' desc, started_at desc;

-- name: recent_repairs
-- Repairs of the last 7 days, newest first, at most %(limit)s.
select * from fleet.recent_repairs
 where (%(lane)s::text is null or lane = %(lane)s)
 order by ts desc, event_id desc
 limit %(limit)s;

-- name: dead_letters
-- Dead letters of the last 30 days, newest first, at most %(limit)s.
select * from fleet.dead_letters
 where (%(lane)s::text is null or lane = %(lane)s)
 order by died_at desc, task_id desc
 limit %(limit)s;

-- name: usage_since
-- Usage per lane and UTC day, for the days from %(since)s on (the view keeps 30 days).
select * from fleet.usage_by_lane_day
 where day >= (%(since)s::timestamptz at time zone 'UTC')::date
   and (%(lane)s::text is null or lane = %(lane)s)
 order by day, lane;

-- name: throughput_since
-- Throughput per lane and UTC hour, for the hours from %(since)s on (the view keeps 30 days).
select * from fleet.throughput_hourly
 where hour >= date_trunc('hour', %(since)s::timestamptz, 'UTC')
   and (%(lane)s::text is null or lane = %(lane)s)
 order by hour, lane;

-- name: cohort
-- The cohort of the tasks queued in [from, to), optionally entered in one lane.
select * from fleet.cohort_metrics(%(from)s::timestamptz, %(to)s::timestamptz, %(lane)s::text);

-- name: cohort_split
-- The same cohort's batched and unbatched tasks apart (one row each).
select * from fleet.cohort_split(%(from)s::timestamptz, %(to)s::timestamptz, %(lane)s::text);

-- name: triage
-- The verdicts of the triage lanes given in [from, to), and how many were wrong (per triage lane and verdict lane).
select * from fleet.triage_metrics(%(from)s::timestamptz, %(to)s::timestamptz, %(lane)s::text);

-- name: entry_lanes
-- The lanes tasks entered the fleet by, among the tasks queued from %(since)s on (for per-lane cohorts).
select distinct coalesce(t.stages -> 0 ->> 'lane', t.lane) as lane
  from fleet.tasks t
 where t.created_at >= %(since)s::timestamptz
 order by 1;

-- name: clock
-- The database's now(): every window counts from it, never from this host's clock.
select now() as now;

-- name: first_activity
-- The first journal entry of the window (fleet.journal_since), so a short history fills the report's charts.
select min(e.ts) as first_ts from fleet.journal_since(%(since)s::timestamptz) e;

-- name: live_counts
-- Queued and running tasks per lane now (the partial indexes of the claim and the monitor).
select l.name as lane,
       (select count(*) from fleet.tasks t where t.lane = l.name and t.state = 'queued') as queued,
       (select count(*) from fleet.tasks t where t.lane = l.name and t.state = 'running') as running
  from fleet.lanes l
 order by l.name;

-- name: queue_deltas
-- Per lane and bucket of %(step)s seconds from %(origin)s: the net change of queued and running
-- tasks, read from the journal (fleet.journal_since). A route counts in both lanes.
select d.lane,
       date_bin(make_interval(secs => %(step)s), e.ts, %(origin)s::timestamptz) as bucket,
       sum(d.dq)::bigint as dq,
       sum(d.dr)::bigint as dr
  from fleet.journal_since(%(origin)s::timestamptz) e
  cross join lateral (values
        (e.lane,
         case when e.kind in ('enqueued', 'retried') then 1
              when e.kind = 'claimed' then -1
              when e.kind = 'cancelled' and e.detail ->> 'was' = 'queued' then -1
              when e.kind in ('failed', 'handed_off', 'repaired') and e.detail ->> 'state' = 'queued' then 1
              else 0 end,
         case when e.kind = 'claimed' then 1
              when e.kind in ('completed', 'failed', 'handed_off', 'repaired', 'routed') then -1
              when e.kind = 'cancelled' and e.detail ->> 'was' = 'running' then -1
              else 0 end),
        (case when e.kind = 'routed' then e.detail ->> 'to' end, 1, 0)) d (lane, dq, dr)
 where e.kind in ('enqueued', 'claimed', 'completed', 'failed', 'handed_off', 'repaired', 'routed',
                  'cancelled', 'retried')
   and d.lane is not null
   and (d.dq <> 0 or d.dr <> 0)
 group by 1, 2
 order by 2, 1;

-- name: run_outcomes
-- Per lane and bucket of %(step)s seconds from %(origin)s: runs that ended, by outcome (fleet._runs_ended_since).
select r.lane,
       date_bin(make_interval(secs => %(step)s), r.ended_at, %(origin)s::timestamptz) as bucket,
       count(*) filter (where r.outcome in ('done', 'routed')) as completed,
       count(*) filter (where r.outcome = 'failed') as failed,
       count(*) filter (where r.outcome = 'handed_off') as handed_off,
       count(*) filter (where r.outcome = 'lost') as lost
  from fleet._runs_ended_since(%(origin)s::timestamptz) r
 where (%(lane)s::text is null or r.lane = %(lane)s)
 group by 1, 2
 order by 2, 1;

-- name: stage_wallclock
-- Stage wall-clock (first claim in the lane -> finish) of each stage completed since %(origin)s.
select r.lane,
       extract(epoch from r.ended_at - coalesce(fc.started_at, r.started_at))::double precision as seconds
  from fleet._runs_ended_since(%(origin)s::timestamptz) r
  left join lateral (
        select r0.started_at from fleet.runs r0
         where r.attempt > 1 and r0.task_id = r.task_id and r0.id < r.id
           and r0.lane = r.lane and r0.attempt = 1
         order by r0.id desc limit 1) fc on true
 where r.outcome in ('done', 'routed')
   and (%(lane)s::text is null or r.lane = %(lane)s);

-- name: usage_days
-- Tokens by kind and cost per UTC day, for the runs that ended since %(origin)s (fleet._runs_ended_since).
select (r.ended_at at time zone 'UTC')::date as day,
       sum(r.input_tokens)::bigint as input_tokens,
       sum(r.cache_creation_tokens)::bigint as cache_creation_tokens,
       sum(r.cache_read_tokens)::bigint as cache_read_tokens,
       sum(r.output_tokens)::bigint as output_tokens,
       sum(r.cost_usd) as cost_usd,
       count(*) filter (where r.outcome in ('done', 'routed')) as completed
  from fleet._runs_ended_since(%(origin)s::timestamptz) r
 where (%(lane)s::text is null or r.lane = %(lane)s)
 group by 1
 order by 1;

-- name: repairs_by_bucket
-- Repairs per bucket of %(step)s seconds from %(origin)s and reason (events_kind_ts).
select date_bin(make_interval(secs => %(step)s), e.ts, %(origin)s::timestamptz) as bucket,
       coalesce(e.detail ->> 'reason', 'unknown') as reason,
       count(*) as n
  from fleet.events e
 where e.kind = 'repaired' and e.ts >= %(origin)s::timestamptz
   and (%(lane)s::text is null or e.lane = %(lane)s)
 group by 1, 2
 order by 1, 2;

-- lanefleet: the operator dashboards (DESIGN §10). Views in schema fleet (lane_overview,
-- stuck_tasks, session_overview, recent_repairs, dead_letters, throughput_hourly,
-- usage_by_lane_day), the function cohort_metrics() for the figures of a set of tasks, and the
-- roll-up of closed hours (fleet.lane_hours) that keeps the two 30-day views cheap.
--
-- Cost: every view reads either the live work (queued and running tasks, active sessions) through
-- the partial indexes the claim and the monitor use, or a fixed time window of the history
-- (24 h, 7 days, 30 days) through an index on its time column. None reads all of history, so a
-- view costs what the live work and the window hold, not what the tables hold.
--
-- Times: hours and days are UTC, whatever the session's TimeZone, so psql, Supabase's SQL editor
-- and Grafana agree. Durations are seconds (numeric, to 0.1 s).
--
-- "Wall-clock" of a stage (a lane's work on a task) is claim -> finish: from the first claim of
-- the task in that lane (its run with attempt 1; the claim counts attempts and a route starts
-- them again at 1) to the end of the run that completed the stage (outcome done or routed). It
-- counts the failed attempts, repairs, back-offs and hand-offs in between.
--
-- The views are plain views (security invoker defaults); grants come with the roles.

------------------------------------------------------------------------------------------------
-- indexes for the time windows

-- runs by their end: throughput, usage, the lanes' p95 of stuck_tasks. It carries the columns the
-- counts need, so most of a window is read from the index alone.
create index runs_ended on fleet.runs (ended_at) include (lane, outcome, started_at, task_id, attempt, id)
    where ended_at is not null;
-- tasks by creation: cohorts, and enqueued per hour
create index tasks_created on fleet.tasks (created_at);
-- the dead letters, newest first
create index tasks_dead on fleet.tasks (finished_at) where state = 'dead';

------------------------------------------------------------------------------------------------
-- lane_overview

create view fleet.lane_overview as
with outcomes as (
    -- the journal's last 24 h of outcomes per lane (events_kind_ts: one range per kind)
    select e.lane,
           count(*) filter (where e.kind = 'completed') as done_24h,
           count(*) filter (where e.kind = 'failed') as failed_24h,
           count(*) filter (where e.kind in ('failed', 'repaired', 'handed_off')
                              and e.detail ->> 'state' = 'dead') as dead_24h,
           count(*) filter (where e.kind = 'cancelled') as cancelled_24h,
           count(*) filter (where e.kind in ('failed', 'repaired')
                              and e.detail ->> 'state' = 'queued') as retries_24h,
           count(*) filter (where e.kind = 'handed_off') as handoffs_24h,
           count(*) filter (where e.kind = 'repaired') as repairs_24h,
           count(*) filter (where e.kind = 'retried') as operator_retries_24h
      from fleet.events e
     where e.kind in ('completed', 'failed', 'repaired', 'handed_off', 'cancelled', 'retried')
       and e.ts >= now() - interval '24 hours'
     group by e.lane
)
select l.name as lane,
       l.paused,
       q.queued,
       q.ready,
       q.queued - q.ready as scheduled,
       r.running,
       l.max_running as slots,
       case when l.max_running is not null then greatest(l.max_running - r.running, 0) end as idle_slots,
       round(extract(epoch from now() - q.oldest_ready_at), 1) as oldest_ready_seconds,
       coalesce(o.done_24h, 0) as done_24h,
       coalesce(o.failed_24h, 0) as failed_24h,
       coalesce(o.dead_24h, 0) as dead_24h,
       coalesce(o.cancelled_24h, 0) as cancelled_24h,
       coalesce(o.retries_24h, 0) as retries_24h,
       coalesce(o.handoffs_24h, 0) as handoffs_24h,
       coalesce(o.repairs_24h, 0) as repairs_24h,
       coalesce(o.operator_retries_24h, 0) as operator_retries_24h,
       s.active_sessions,
       h.created_at as last_handoff_at
  from fleet.lanes l
  -- queued rows of the lane: tasks_ready (partial, queued only)
  cross join lateral (
        select count(*) as queued,
               count(*) filter (where t.run_at <= now()) as ready,
               min(t.run_at) filter (where t.run_at <= now()) as oldest_ready_at
          from fleet.tasks t
         where t.lane = l.name and t.state = 'queued') q
  -- running rows of the lane: tasks_running_lane (partial, running only)
  cross join lateral (
        select count(*) as running from fleet.tasks t where t.lane = l.name and t.state = 'running') r
  cross join lateral (
        select count(*) as active_sessions
          from fleet.sessions s where s.lane = l.name and s.state = 'active') s
  left join lateral (
        select h.created_at from fleet.lane_handoffs h where h.lane = l.name order by h.id desc limit 1) h
    on true
  left join outcomes o on o.lane = l.name
 order by l.name;

comment on view fleet.lane_overview is
    'One row per lane: what waits, what runs, free slots, and the outcomes of the last 24 h '
    '(from fleet.events). Reads the live rows through the partial indexes and 24 h of the journal.';
comment on column fleet.lane_overview.lane is 'the lane';
comment on column fleet.lane_overview.paused is 'the lane is paused: nothing is claimed';
comment on column fleet.lane_overview.queued is 'tasks in state queued (ready now or scheduled later)';
comment on column fleet.lane_overview.ready is 'queued tasks whose run_at has come: a claim would take them now';
comment on column fleet.lane_overview.scheduled is 'queued tasks waiting for a later run_at (retry back-off, --run-at)';
comment on column fleet.lane_overview.running is 'tasks in state running (leased to a session)';
comment on column fleet.lane_overview.slots is 'max_running: slots across the fleet (NULL: unlimited)';
comment on column fleet.lane_overview.idle_slots is 'slots - running, at least 0 (NULL: unlimited)';
comment on column fleet.lane_overview.oldest_ready_seconds is
    'seconds the oldest ready task has been ready (now - its run_at); NULL when nothing is ready';
comment on column fleet.lane_overview.done_24h is 'tasks completed in the last 24 h (completed events)';
comment on column fleet.lane_overview.failed_24h is
    'failed attempts in the last 24 h (failed events; a task that failed twice counts twice)';
comment on column fleet.lane_overview.dead_24h is
    'tasks that became dead letters in the last 24 h (attempt cap, fatal error, hand-off cap or a repair at the cap)';
comment on column fleet.lane_overview.cancelled_24h is 'tasks cancelled in the last 24 h';
comment on column fleet.lane_overview.retries_24h is
    'automatic retries in the last 24 h: failed attempts and repairs that put the task back in the queue';
comment on column fleet.lane_overview.handoffs_24h is 'hand-offs to the next shift in the last 24 h';
comment on column fleet.lane_overview.repairs_24h is
    'running tasks the monitor (or a closing shift) released in the last 24 h: evaporated claims';
comment on column fleet.lane_overview.operator_retries_24h is 'dead or cancelled tasks an operator queued again in the last 24 h';
comment on column fleet.lane_overview.active_sessions is 'shifts of the lane with an active session';
comment on column fleet.lane_overview.last_handoff_at is 'when the lane''s last shift wrote its hand-off snapshot';

------------------------------------------------------------------------------------------------
-- stuck_tasks

create view fleet.stuck_tasks as
with running as (
    -- the running tasks (tasks_running_lease), their open run and the start of their stage
    select t.id, t.lane, t.key, t.title, t.session_id, t.attempts, t.lease_expires_at,
           t.last_progress_at, r.started_at as run_started_at,
           coalesce(fc.started_at, r.started_at) as stage_started_at,
           l.lease_seconds, coalesce(l.session_timeout_seconds, l.lease_seconds) as session_timeout,
           (l.config ->> 'stall_seconds')::numeric as stall_seconds
      from fleet.tasks t
      join fleet.lanes l on l.name = t.lane
      join fleet.runs r on r.lease_token = t.lease_token
      left join lateral (
            select r0.started_at from fleet.runs r0
             where r.attempt > 1 and r0.task_id = r.task_id and r0.id < r.id
               and r0.lane = r.lane and r0.attempt = 1
             order by r0.id desc limit 1) fc on true
     where t.state = 'running'
), p95 as (
    -- per lane with running work: p95 stage wall-clock of the stages completed in 7 days
    select c.lane, count(*) as completed,
           percentile_cont(0.95) within group (order by extract(epoch from c.ended_at - c.stage_started_at))
               as p95_seconds
      from (select r.lane, r.ended_at, coalesce(fc.started_at, r.started_at) as stage_started_at
              from fleet.runs r
              left join lateral (
                    select r0.started_at from fleet.runs r0
                     where r.attempt > 1 and r0.task_id = r.task_id and r0.id < r.id
                       and r0.lane = r.lane and r0.attempt = 1
                     order by r0.id desc limit 1) fc on true
             where r.ended_at >= now() - interval '7 days'
               and r.outcome in ('done', 'routed')
               and r.lane in (select lane from running)) c
     group by c.lane
), judged as (
    select x.*, s.host, s.pid, s.state as session_state, s.heartbeat_at,
           p.p95_seconds, p.completed,
           array_remove(array[
               case when x.lease_expires_at < now() then 'lease-expired'
                    when x.lease_expires_at < now() + least(interval '1 minute',
                                                            make_interval(secs => x.lease_seconds / 3.0))
                    then 'lease-expiring' end,
               case when s.state = 'lost' then 'session-lost'
                    when s.state = 'ended' then 'session-ended'
                    when s.heartbeat_at < now() - make_interval(secs => x.session_timeout)
                    then 'session-silent' end,
               case when p.completed >= 10
                         and extract(epoch from now() - x.stage_started_at) > p.p95_seconds
                    then 'over-p95' end,
               case when x.stall_seconds is not null
                         and now() - greatest(x.last_progress_at, x.run_started_at)
                             > make_interval(secs => x.stall_seconds::double precision)
                    then 'stalled' end], null) as reasons
      from running x
      join fleet.sessions s on s.id = x.session_id
      left join p95 p on p.lane = x.lane
)
select j.id as task_id,
       j.lane,
       j.key,
       j.title,
       j.reasons,
       j.session_id,
       j.host,
       j.pid,
       j.session_state,
       j.attempts as attempt,
       j.stage_started_at,
       round(extract(epoch from now() - j.stage_started_at), 1) as running_seconds,
       round(p95_seconds::numeric, 1) as lane_p95_seconds,
       j.lease_expires_at,
       round(extract(epoch from j.lease_expires_at - now()), 1) as lease_remaining_seconds,
       round(extract(epoch from now() - j.heartbeat_at), 1) as heartbeat_age_seconds,
       j.last_progress_at
  from judged j
 where cardinality(j.reasons) > 0
 order by j.stage_started_at, j.id;

comment on view fleet.stuck_tasks is
    'Running tasks that look stuck, with the reasons: lease expired or about to (less than '
    'min(1 minute, lease/3) left: two heartbeats missed), session lost, ended or silent, running longer '
    'than the lane''s p95 stage wall-clock (7 days, at least 10 completions), no progress for the lane''s '
    'config.stall_seconds. Reads only running tasks.';
comment on column fleet.stuck_tasks.task_id is 'the task';
comment on column fleet.stuck_tasks.lane is 'its lane';
comment on column fleet.stuck_tasks.key is 'its idempotency key';
comment on column fleet.stuck_tasks.title is 'its title';
comment on column fleet.stuck_tasks.reasons is
    'why it is listed: lease-expired, lease-expiring, session-lost, session-ended, session-silent '
    '(no heartbeat for the session timeout), over-p95, stalled';
comment on column fleet.stuck_tasks.session_id is 'the session (shift) holding it';
comment on column fleet.stuck_tasks.host is 'the host of that session';
comment on column fleet.stuck_tasks.pid is 'the pid of that shift on its host';
comment on column fleet.stuck_tasks.session_state is 'active, ended or lost';
comment on column fleet.stuck_tasks.attempt is 'claims of the task in this lane, this one included';
comment on column fleet.stuck_tasks.stage_started_at is 'the first claim of the task in this lane';
comment on column fleet.stuck_tasks.running_seconds is 'seconds since stage_started_at (its wall-clock so far)';
comment on column fleet.stuck_tasks.lane_p95_seconds is
    'p95 stage wall-clock of the lane''s stages completed in the last 7 days (NULL: none)';
comment on column fleet.stuck_tasks.lease_expires_at is 'when the lease runs out unless renewed';
comment on column fleet.stuck_tasks.lease_remaining_seconds is 'seconds left on the lease (negative: expired)';
comment on column fleet.stuck_tasks.heartbeat_age_seconds is 'seconds since the session''s last heartbeat';
comment on column fleet.stuck_tasks.last_progress_at is 'the last checkpoint (NULL: none yet)';

------------------------------------------------------------------------------------------------
-- session_overview

create view fleet.session_overview as
with chosen as (
    -- active sessions (partial index), and the others started in the last 24 h (sessions_started)
    select s.* from fleet.sessions s where s.state = 'active'
    union all
    select s.* from fleet.sessions s
     where s.state <> 'active' and s.started_at >= now() - interval '24 hours'
)
select s.id as session_id,
       s.lane,
       s.host,
       s.pid,
       s.state,
       s.started_at,
       round(extract(epoch from coalesce(s.ended_at, now()) - s.started_at), 1) as age_seconds,
       s.deadline,
       round(extract(epoch from s.deadline - now()), 1) as deadline_in_seconds,
       s.heartbeat_at,
       round(extract(epoch from now() - s.heartbeat_at), 1) as heartbeat_age_seconds,
       held.tasks_held,
       ran.runs,
       ran.done,
       ran.failed,
       ran.handed_off,
       ran.lost,
       ran.tokens,
       ran.cost_usd,
       s.ended_at,
       s.end_reason
  from chosen s
  cross join lateral (
        select count(*) as tasks_held
          from fleet.tasks t where t.session_id = s.id and t.state = 'running') held
  cross join lateral (
        select count(*) as runs,
               count(*) filter (where r.outcome in ('done', 'routed')) as done,
               count(*) filter (where r.outcome = 'failed') as failed,
               count(*) filter (where r.outcome = 'handed_off') as handed_off,
               count(*) filter (where r.outcome = 'lost') as lost,
               coalesce(sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens
                            + r.output_tokens), 0)::bigint as tokens,
               coalesce(sum(r.cost_usd), 0) as cost_usd
          from fleet.runs r where r.session_id = s.id) ran
 order by s.state = 'active' desc, s.started_at desc;

comment on view fleet.session_overview is
    'Shifts: every active session, and the others started in the last 24 h, with what each holds '
    'and ran.';
comment on column fleet.session_overview.session_id is 'the session (one per shift)';
comment on column fleet.session_overview.lane is 'its lane';
comment on column fleet.session_overview.host is 'the host the shift runs on';
comment on column fleet.session_overview.pid is 'the shift''s pid on that host';
comment on column fleet.session_overview.state is 'active, ended (closed by the shift) or lost (declared by the monitor)';
comment on column fleet.session_overview.started_at is 'when the shift opened its session';
comment on column fleet.session_overview.age_seconds is 'how long the shift has run (to its end, once ended)';
comment on column fleet.session_overview.deadline is 'when the shift is to stop claiming and hand off';
comment on column fleet.session_overview.deadline_in_seconds is 'seconds to the deadline (negative: past it)';
comment on column fleet.session_overview.heartbeat_at is 'its last heartbeat (or claim)';
comment on column fleet.session_overview.heartbeat_age_seconds is 'seconds since that heartbeat';
comment on column fleet.session_overview.tasks_held is 'running tasks it holds now';
comment on column fleet.session_overview.runs is 'tasks it claimed (runs)';
comment on column fleet.session_overview.done is 'of those, runs that completed the task or its stage (done or routed)';
comment on column fleet.session_overview.failed is 'runs that failed';
comment on column fleet.session_overview.handed_off is 'runs handed off to the next shift';
comment on column fleet.session_overview.lost is 'runs the monitor (or its own close) had to repair';
comment on column fleet.session_overview.tokens is 'tokens of its runs, every kind';
comment on column fleet.session_overview.cost_usd is 'cost of its runs';
comment on column fleet.session_overview.ended_at is 'when it ended (NULL: active)';
comment on column fleet.session_overview.end_reason is 'why it ended (deadline, signal, heartbeat-timeout, pid-gone, ...)';

------------------------------------------------------------------------------------------------
-- recent_repairs

create view fleet.recent_repairs as
select e.id as event_id,
       e.ts,
       e.lane,
       e.task_id,
       t.key,
       t.title,
       e.detail ->> 'reason' as reason,
       e.detail ->> 'state' as state,
       (e.detail ->> 'attempt')::int as attempt,
       (e.detail ->> 'evaporations')::int as evaporations,
       (e.detail ->> 'lease_expired_at')::timestamptz as lease_expired_at,
       e.session_id,
       s.host,
       s.pid
  from fleet.events e
  left join fleet.tasks t on t.id = e.task_id
  left join fleet.sessions s on s.id = e.session_id
 where e.kind = 'repaired' and e.ts >= now() - interval '7 days'
 order by e.ts desc, e.id desc;

comment on view fleet.recent_repairs is
    'Repairs of the last 7 days, newest first: running tasks released because their worker vanished '
    '(events of kind repaired; events_kind_ts).';
comment on column fleet.recent_repairs.event_id is 'the journal row';
comment on column fleet.recent_repairs.ts is 'when the task was released';
comment on column fleet.recent_repairs.lane is 'its lane';
comment on column fleet.recent_repairs.task_id is 'the task';
comment on column fleet.recent_repairs.key is 'its key';
comment on column fleet.recent_repairs.title is 'its title';
comment on column fleet.recent_repairs.reason is
    'lease-expired, heartbeat-timeout, session-ended, session-closed, pid-gone, pid-reused, not-run-by-shift, ...';
comment on column fleet.recent_repairs.state is 'where the task went: queued, or dead (its attempt cap was spent)';
comment on column fleet.recent_repairs.attempt is 'the claim that was lost (the task''s attempts then)';
comment on column fleet.recent_repairs.evaporations is 'the task''s evaporations after this repair';
comment on column fleet.recent_repairs.lease_expired_at is 'when its lease was due';
comment on column fleet.recent_repairs.session_id is 'the session that held it';
comment on column fleet.recent_repairs.host is 'that session''s host';
comment on column fleet.recent_repairs.pid is 'that shift''s pid';

------------------------------------------------------------------------------------------------
-- dead_letters

create view fleet.dead_letters as
select t.id as task_id,
       t.lane,
       t.key,
       t.title,
       t.dead_reason,
       coalesce(t.last_error, lr.error_tail) as last_error,
       t.attempts,
       t.failures,
       t.evaporations,
       t.handoffs,
       lr.outcome as last_run_outcome,
       lr.exit_code as last_exit_code,
       t.created_at,
       t.finished_at as died_at
  from fleet.tasks t
  left join lateral (
        select r.outcome, r.exit_code, r.error_tail
          from fleet.runs r where r.task_id = t.id order by r.id desc limit 1) lr on true
 where t.state = 'dead' and t.finished_at >= now() - interval '30 days'
 order by t.finished_at desc, t.id desc;

comment on view fleet.dead_letters is
    'Dead letters of the last 30 days, newest first (tasks_dead). Older ones: '
    'select * from fleet.tasks where state = ''dead''. Queue one again with fleet.retry(id).';
comment on column fleet.dead_letters.task_id is 'the task';
comment on column fleet.dead_letters.lane is 'its lane';
comment on column fleet.dead_letters.key is 'its key';
comment on column fleet.dead_letters.title is 'its title';
comment on column fleet.dead_letters.dead_reason is 'attempt-cap, fatal or handoff-cap';
comment on column fleet.dead_letters.last_error is
    'its last error (or, when it died in a repair, the last run''s: released: <reason>)';
comment on column fleet.dead_letters.attempts is 'claims in its current lane';
comment on column fleet.dead_letters.failures is 'failed attempts';
comment on column fleet.dead_letters.evaporations is 'claims the monitor had to repair';
comment on column fleet.dead_letters.handoffs is 'hand-offs';
comment on column fleet.dead_letters.last_run_outcome is 'how its last run ended (failed, lost, handed_off)';
comment on column fleet.dead_letters.last_exit_code is 'the exit code of its last run, when reported';
comment on column fleet.dead_letters.created_at is 'when it was queued';
comment on column fleet.dead_letters.died_at is 'when it became dead';

------------------------------------------------------------------------------------------------
-- per lane and hour: the figures behind throughput_hourly and usage_by_lane_day
--
-- A 30-day window of a busy fleet holds some 100,000 runs; aggregating them on every read costs
-- more than a dashboard may. So the closed hours are rolled up into fleet.lane_hours (a row per
-- lane and hour with activity) by fleet.roll_up_lane_hours(), which the monitor pass and the
-- dashboard commands call, and a view reads the rolled-up hours and computes only the hours after
-- them live. The live computation and the roll-up are the same function, so a view says the same
-- whether or not (and however long ago) the roll-up ran; it is only slower without it.

-- UTC hours: date_bin() from a UTC midnight (plain arithmetic, unlike a time-zone conversion)
create or replace function fleet._utc_hour(p_ts timestamptz)
returns timestamptz
language sql
immutable
parallel safe
as $$
    select date_bin('1 hour', p_ts, timestamptz '2000-01-01 00:00:00+00');
$$;

create table fleet.lane_hours (
    lane text not null,
    hour timestamptz not null,
    enqueued bigint not null,
    routed_in bigint not null,
    started bigint not null,
    done bigint not null,
    routed bigint not null,
    failed bigint not null,
    handed_off bigint not null,
    lost bigint not null,
    cancelled bigint not null,
    wall_p50_seconds numeric,
    wall_p95_seconds numeric,
    runs_ended bigint not null,
    input_tokens bigint not null,
    cache_creation_tokens bigint not null,
    cache_read_tokens bigint not null,
    output_tokens bigint not null,
    cost_usd numeric not null,
    primary key (hour, lane)
);

comment on table fleet.lane_hours is
    'Rolled-up hours (UTC) per lane, written by fleet.roll_up_lane_hours(): the closed hours behind '
    'throughput_hourly and usage_by_lane_day. Columns as in fleet.lane_hours_between().';

-- how far the roll-up has come: hours before rolled_until are in fleet.lane_hours
create table fleet.lane_hours_rollup (
    singleton boolean primary key default true constraint lane_hours_rollup_one_row check (singleton),
    rolled_until timestamptz not null,
    rolled_at timestamptz not null default now()
);

comment on table fleet.lane_hours_rollup is
    'One row: the hours before rolled_until are rolled up in fleet.lane_hours (rolled_at: when).';

-- The figures of every lane and UTC hour in [p_from, p_to) with any activity, computed from the
-- tables: what the roll-up stores and what the views compute live for the hours after it.
create or replace function fleet.lane_hours_between(p_from timestamptz, p_to timestamptz)
returns setof fleet.lane_hours
language sql
stable
as $$
    with ran as (
        -- every run that started or ended in the range: those that ended since p_from
        -- (runs_ended), and the open ones (runs_open)
        select r.id, r.task_id, r.lane, r.attempt, r.outcome, r.started_at, r.ended_at,
               r.input_tokens, r.cache_creation_tokens, r.cache_read_tokens, r.output_tokens, r.cost_usd
          from fleet.runs r
         where r.ended_at >= p_from
        union all
        select r.id, r.task_id, r.lane, r.attempt, r.outcome, r.started_at, r.ended_at,
               0, 0, 0, 0, 0
          from fleet.runs r
         where r.ended_at is null and r.started_at >= p_from
    ), facts as (
        -- runs that ended in the range, by outcome, with tokens and the stage wall-clock of the
        -- completed stages (a stage starts at the run with attempt 1: runs_task, few rows)
        select r.lane, fleet._utc_hour(r.ended_at) as hour,
               0::bigint as enqueued, 0::bigint as routed_in, 0::bigint as started,
               count(*) filter (where r.outcome = 'done') as done,
               count(*) filter (where r.outcome = 'routed') as routed,
               count(*) filter (where r.outcome = 'failed') as failed,
               count(*) filter (where r.outcome = 'handed_off') as handed_off,
               count(*) filter (where r.outcome = 'lost') as lost,
               count(*) filter (where r.outcome = 'cancelled') as cancelled,
               percentile_cont(array[0.5, 0.95]) within group (
                   order by extract(epoch from r.ended_at - coalesce(fc.started_at, r.started_at))::double precision)
                   filter (where r.outcome in ('done', 'routed')) as walls,
               count(*) as runs_ended,
               sum(r.input_tokens)::bigint as input_tokens,
               sum(r.cache_creation_tokens)::bigint as cache_creation_tokens,
               sum(r.cache_read_tokens)::bigint as cache_read_tokens,
               sum(r.output_tokens)::bigint as output_tokens,
               sum(r.cost_usd) as cost_usd
          from ran r
          left join lateral (
                select r0.started_at from fleet.runs r0
                 where r.attempt > 1 and r.outcome in ('done', 'routed')
                   and r0.task_id = r.task_id and r0.id < r.id and r0.lane = r.lane and r0.attempt = 1
                 order by r0.id desc limit 1) fc on true
         where r.ended_at < p_to
         group by 1, 2
        union all
        -- claims
        select r.lane, fleet._utc_hour(r.started_at), 0, 0, count(*), 0, 0, 0, 0, 0, 0, null, 0, 0, 0, 0, 0, 0
          from ran r
         where r.started_at >= p_from and r.started_at < p_to
         group by 1, 2
        union all
        -- new tasks, in the lane they entered (tasks_created; a routed task keeps it in stages[0])
        select coalesce(t.stages -> 0 ->> 'lane', t.lane), fleet._utc_hour(t.created_at),
               count(*), 0, 0, 0, 0, 0, 0, 0, 0, null, 0, 0, 0, 0, 0, 0
          from fleet.tasks t
         where t.created_at >= p_from and t.created_at < p_to
         group by 1, 2
        union all
        -- tasks routed in from another lane (events_kind_ts)
        select e.detail ->> 'to', fleet._utc_hour(e.ts), 0, count(*), 0, 0, 0, 0, 0, 0, 0, null, 0, 0, 0, 0, 0, 0
          from fleet.events e
         where e.kind = 'routed' and e.ts >= p_from and e.ts < p_to
         group by 1, 2
    )
    select f.lane, f.hour,
           sum(f.enqueued)::bigint, sum(f.routed_in)::bigint, sum(f.started)::bigint, sum(f.done)::bigint,
           sum(f.routed)::bigint, sum(f.failed)::bigint, sum(f.handed_off)::bigint, sum(f.lost)::bigint,
           sum(f.cancelled)::bigint,
           round(max(f.walls[1])::numeric, 1), round(max(f.walls[2])::numeric, 1),
           sum(f.runs_ended)::bigint, sum(f.input_tokens)::bigint, sum(f.cache_creation_tokens)::bigint,
           sum(f.cache_read_tokens)::bigint, sum(f.output_tokens)::bigint, sum(f.cost_usd)
      from facts f
     group by f.lane, f.hour;
$$;

comment on function fleet.lane_hours_between(timestamptz, timestamptz) is
    'Per lane and UTC hour in [p_from, p_to) with any activity: enqueued, routed_in, started, the '
    'outcomes of the runs that ended, stage wall-clock p50/p95 of the stages completed, tokens and '
    'cost of the runs that ended. Computed from the tables (cost follows the range).';

-- Where the rolled-up hours end (NULL: nothing rolled up). Stable: the planner reads it when it
-- estimates the live part of a view, so the live part is planned for its real (small) range.
create or replace function fleet.lane_hours_rolled_until()
returns timestamptz
language sql
stable
as $$
    select rolled_until from fleet.lane_hours_rollup;
$$;

-- The hours from p_from on: rolled up where they are, computed live after that.
create or replace function fleet.lane_hours_since(p_from timestamptz)
returns setof fleet.lane_hours
language sql
stable
as $$
    select h.* from fleet.lane_hours h
     where h.hour >= p_from and h.hour < fleet.lane_hours_rolled_until()
    union all
    select * from fleet.lane_hours_between(greatest(p_from, fleet.lane_hours_rolled_until()), 'infinity');
$$;

comment on function fleet.lane_hours_since(timestamptz) is
    'The lane_hours rows from p_from on: the rolled-up hours from fleet.lane_hours, the later ones '
    'computed live by fleet.lane_hours_between().';

-- Roll up the closed hours: those that ended more than p_lag_seconds ago. Nothing to do (the
-- common case) costs one row read. When an hour has closed, the last two hours rolled up before
-- are computed again, for the writes that land late (a run's tokens recorded after its end, a
-- transaction that began before the hour ended). The first call rolls up 30 days.
-- Under a transaction-scoped advisory lock: a concurrent call returns -1 and writes nothing.
-- Security definer, so a role allowed to call it (the monitor, an operator) needs no write grant
-- on fleet.lane_hours. Returns the number of rows written.
create or replace function fleet.roll_up_lane_hours(p_lag_seconds int default 300)
returns int
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_until timestamptz := fleet._utc_hour(now() - make_interval(secs => greatest(coalesce(p_lag_seconds, 300), 0)));
    v_done timestamptz;
    v_from timestamptz;
    v_rows int;
begin
    if (select rolled_until from fleet.lane_hours_rollup) >= v_until then
        return 0;  -- no hour has closed since the last roll-up: nothing written, nothing locked
    end if;
    if not pg_try_advisory_xact_lock(7366104385829013) then
        return -1;
    end if;
    select rolled_until into v_done from fleet.lane_hours_rollup for update;
    if v_done >= v_until then
        return 0;  -- a concurrent roll-up did it meanwhile
    end if;
    v_from := greatest(coalesce(v_done - interval '2 hours', '-infinity'), fleet._utc_hour(now()) - interval '720 hours');
    delete from fleet.lane_hours where hour >= v_from and hour < v_until;
    insert into fleet.lane_hours select * from fleet.lane_hours_between(v_from, v_until);
    get diagnostics v_rows = row_count;
    insert into fleet.lane_hours_rollup as s (singleton, rolled_until, rolled_at) values (true, v_until, now())
    on conflict (singleton) do update set rolled_until = greatest(s.rolled_until, excluded.rolled_until),
                                          rolled_at = excluded.rolled_at;
    -- keep a year and a month of hours
    delete from fleet.lane_hours where hour < now() - interval '400 days';
    return v_rows;
end
$$;

-- a security-definer function is callable by PUBLIC unless revoked; roles are granted it by the
-- migration that creates them (the monitor's and the operators')
revoke all on function fleet.roll_up_lane_hours(int) from public;

comment on function fleet.roll_up_lane_hours(int) is
    'Roll the closed hours (ended more than p_lag_seconds ago) up into fleet.lane_hours, recomputing '
    'the last two hours rolled up before; called by the monitor pass and the dashboard commands. '
    'Returns the rows written (-1: another roll-up was running).';

------------------------------------------------------------------------------------------------
-- throughput_hourly

create view fleet.throughput_hourly as
select h.lane, h.hour, h.enqueued, h.routed_in, h.started, h.done, h.routed, h.failed, h.handed_off,
       h.lost, h.cancelled, h.wall_p50_seconds, h.wall_p95_seconds
  from fleet.lane_hours_since(fleet._utc_hour(now()) - interval '719 hours') h
 order by h.hour desc, h.lane;

comment on view fleet.throughput_hourly is
    'Per lane and UTC hour, over the last 30 days (720 hours, this one included; an hour without '
    'activity has no row): tasks arriving, claims, the outcomes of the runs that ended, and the '
    'median and p95 stage wall-clock (first claim in the lane -> finish) of the stages completed. '
    'Closed hours come from fleet.lane_hours (see fleet.roll_up_lane_hours), later ones are computed '
    'live; older history: fleet.lane_hours_between(from, to).';
comment on column fleet.throughput_hourly.lane is 'the lane';
comment on column fleet.throughput_hourly.hour is 'the hour (UTC), as a timestamptz at its start';
comment on column fleet.throughput_hourly.enqueued is 'new tasks queued in this lane';
comment on column fleet.throughput_hourly.routed_in is 'tasks routed into this lane from another';
comment on column fleet.throughput_hourly.started is 'claims (runs started)';
comment on column fleet.throughput_hourly.done is 'runs that completed their task';
comment on column fleet.throughput_hourly.routed is 'runs that completed their stage and routed the task on';
comment on column fleet.throughput_hourly.failed is 'failed attempts (retried or dead)';
comment on column fleet.throughput_hourly.handed_off is 'runs handed off to the next shift';
comment on column fleet.throughput_hourly.lost is 'runs repaired (released) by the monitor';
comment on column fleet.throughput_hourly.cancelled is 'running tasks cancelled by an operator';
comment on column fleet.throughput_hourly.wall_p50_seconds is
    'median stage wall-clock, in seconds, of the stages completed (done or routed) in this hour';
comment on column fleet.throughput_hourly.wall_p95_seconds is 'p95 of the same';

------------------------------------------------------------------------------------------------
-- usage_by_lane_day

create view fleet.usage_by_lane_day as
select h.lane,
       (h.hour at time zone 'UTC')::date as day,
       sum(h.runs_ended)::bigint as runs,
       sum(h.done + h.routed)::bigint as completed,
       sum(h.input_tokens)::bigint as input_tokens,
       sum(h.cache_creation_tokens)::bigint as cache_creation_tokens,
       sum(h.cache_read_tokens)::bigint as cache_read_tokens,
       sum(h.output_tokens)::bigint as output_tokens,
       sum(h.input_tokens + h.cache_creation_tokens + h.cache_read_tokens + h.output_tokens)::bigint
           as total_tokens,
       round(sum(h.cache_read_tokens)::numeric
             / nullif(sum(h.input_tokens + h.cache_creation_tokens + h.cache_read_tokens), 0), 4)
           as cache_read_share,
       sum(h.cost_usd) as cost_usd,
       round(sum(h.cost_usd) / nullif(sum(h.done + h.routed), 0), 6) as cost_per_completed,
       round(sum(h.input_tokens + h.cache_creation_tokens + h.cache_read_tokens + h.output_tokens)::numeric
             / nullif(sum(h.done + h.routed), 0), 1) as tokens_per_completed
  from fleet.lane_hours_since(date_trunc('day', now(), 'UTC') - interval '29 days') h
 group by h.lane, (h.hour at time zone 'UTC')::date
having sum(h.runs_ended) > 0
 order by day desc, h.lane;

comment on view fleet.usage_by_lane_day is
    'Tokens and cost per lane and UTC day, over the last 30 days (today included), from fleet.runs '
    '(whose tokens are the agent''s modelUsage sums, sub-agents included). A run counts on the day '
    'it ended; runs still open are not counted yet. Closed hours come from fleet.lane_hours.';
comment on column fleet.usage_by_lane_day.lane is 'the lane';
comment on column fleet.usage_by_lane_day.day is 'the UTC day the runs ended';
comment on column fleet.usage_by_lane_day.runs is 'runs (attempts) that ended';
comment on column fleet.usage_by_lane_day.completed is 'of those, runs that completed the task or its stage (done or routed)';
comment on column fleet.usage_by_lane_day.input_tokens is 'fresh input tokens (not from the cache)';
comment on column fleet.usage_by_lane_day.cache_creation_tokens is 'input tokens written to the prompt cache';
comment on column fleet.usage_by_lane_day.cache_read_tokens is 'input tokens read from the prompt cache';
comment on column fleet.usage_by_lane_day.output_tokens is 'output tokens';
comment on column fleet.usage_by_lane_day.total_tokens is 'all four kinds';
comment on column fleet.usage_by_lane_day.cache_read_share is
    'cache_read / (input + cache_creation + cache_read): the share of input served from the cache';
comment on column fleet.usage_by_lane_day.cost_usd is 'cost reported by the agents, USD';
comment on column fleet.usage_by_lane_day.cost_per_completed is
    'cost_usd / completed: what a completed task (or stage) cost, failed attempts included';
comment on column fleet.usage_by_lane_day.tokens_per_completed is 'total_tokens / completed';

------------------------------------------------------------------------------------------------
-- cohort_metrics

create or replace function fleet.cohort_metrics(p_from timestamptz, p_to timestamptz, p_lane text default null)
returns table (
    lane text,
    cohort_from timestamptz,
    cohort_to timestamptz,
    tasks bigint,
    completed bigint,
    dead bigint,
    cancelled bigint,
    open bigint,
    first_claim_at timestamptz,
    last_finish_at timestamptz,
    makespan_seconds numeric,
    wall_p50_seconds numeric,
    wall_p95_seconds numeric,
    runs bigint,
    attempts_per_task numeric,
    failures bigint,
    handoffs bigint,
    repairs bigint,
    input_tokens bigint,
    cache_creation_tokens bigint,
    cache_read_tokens bigint,
    output_tokens bigint,
    total_tokens bigint,
    cost_usd numeric,
    tokens_per_completed numeric,
    cost_per_completed numeric,
    operator_cancels bigint,
    operator_retries bigint,
    interventions bigint)
language sql
stable
as $$
    with cohort as (
        -- the tasks queued in [p_from, p_to) (tasks_created), in p_lane if given: the lane they
        -- entered the fleet by (a routed task keeps its first lane in stages[0])
        select t.id, t.state, t.finished_at
          from fleet.tasks t
         where t.created_at >= p_from and t.created_at < p_to
           and (p_lane is null or coalesce(t.stages -> 0 ->> 'lane', t.lane) = p_lane)
    ), cohort_runs as (
        -- the runs of the cohort, every stage. A recent cohort: the runs started since p_from
        -- (runs_started; a task runs after it is queued) matched to the cohort's tasks by hash. An
        -- older one: looked up task by task (runs_task), so that its cost follows the cohort and
        -- not the runs of all the months since.
        select r.task_id, r.started_at, r.outcome, r.input_tokens, r.cache_creation_tokens,
               r.cache_read_tokens, r.output_tokens, r.cost_usd
          from fleet.runs r
          join fleet.tasks t on t.id = r.task_id
         where p_from >= now() - interval '35 days'
           and r.started_at >= p_from
           and t.created_at >= p_from and t.created_at < p_to
           and (p_lane is null or coalesce(t.stages -> 0 ->> 'lane', t.lane) = p_lane)
        union all
        select r.*
          from cohort c
          cross join lateral (
                select r.task_id, r.started_at, r.outcome, r.input_tokens, r.cache_creation_tokens,
                       r.cache_read_tokens, r.output_tokens, r.cost_usd
                  from fleet.runs r where r.task_id = c.id
                offset 0) r  -- keeps the lookup per task (the planner would scan every run since)
         where p_from < now() - interval '35 days'
    ), per_task as (
        -- each task and its first claim
        select c.id, c.state, c.finished_at, f.first_claim_at
          from cohort c
          left join (select task_id, min(started_at) as first_claim_at from cohort_runs group by task_id) f
            on f.task_id = c.id
    ), run_totals as (
        select count(*) as runs,
               count(*) filter (where outcome = 'failed') as failures,
               count(*) filter (where outcome = 'handed_off') as handoffs,
               count(*) filter (where outcome = 'lost') as repairs,
               coalesce(sum(input_tokens), 0) as input_tokens,
               coalesce(sum(cache_creation_tokens), 0) as cache_creation_tokens,
               coalesce(sum(cache_read_tokens), 0) as cache_read_tokens,
               coalesce(sum(output_tokens), 0) as output_tokens,
               coalesce(sum(cost_usd), 0) as cost_usd
          from cohort_runs
    ), operator as (
        -- cancels and manual retries of cohort tasks (events_kind_ts: rare kinds, from p_from on)
        select count(*) filter (where e.kind = 'cancelled') as cancels,
               count(*) filter (where e.kind = 'retried') as retries
          from fleet.events e
         where e.kind in ('cancelled', 'retried') and e.ts >= p_from
           and e.task_id in (select id from cohort)
    ), totals as (
        select count(*) as tasks,
               count(*) filter (where p.state = 'done') as completed,
               count(*) filter (where p.state = 'dead') as dead,
               count(*) filter (where p.state = 'cancelled') as cancelled,
               count(*) filter (where p.state in ('queued', 'running')) as open,
               min(p.first_claim_at) as first_claim_at,
               max(p.finished_at) filter (where p.state in ('done', 'dead')) as last_finish_at,
               -- both percentiles from one sort
               percentile_cont(array[0.5, 0.95]) within group (
                   order by extract(epoch from p.finished_at - p.first_claim_at)::double precision)
                   filter (where p.state = 'done') as walls
          from per_task p
    )
    select p_lane, p_from, p_to,
           t.tasks, t.completed, t.dead, t.cancelled, t.open,
           t.first_claim_at, t.last_finish_at,
           round(extract(epoch from t.last_finish_at - t.first_claim_at), 1),
           round(t.walls[1]::numeric, 1),
           round(t.walls[2]::numeric, 1),
           u.runs,
           round(u.runs::numeric / nullif(t.tasks, 0), 2),
           u.failures, u.handoffs, u.repairs,
           u.input_tokens::bigint, u.cache_creation_tokens::bigint, u.cache_read_tokens::bigint,
           u.output_tokens::bigint,
           (u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens + u.output_tokens)::bigint,
           u.cost_usd,
           round((u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens + u.output_tokens)::numeric
                 / nullif(t.completed, 0), 1),
           round(u.cost_usd / nullif(t.completed, 0), 6),
           o.cancels, o.retries, o.cancels + o.retries
      from totals t cross join run_totals u cross join operator o;
$$;

comment on function fleet.cohort_metrics(timestamptz, timestamptz, text) is
    'The figures of a cohort: the tasks queued in [p_from, p_to), optionally only those that entered '
    'the fleet in lane p_lane, counted over all their stages and runs up to now. completed/dead/'
    'cancelled/open: their states now; makespan: first claim -> last finish (done or dead); wall-clock: '
    'per completed task, first claim -> finish (p50, p95); attempts_per_task: runs / tasks; failures, '
    'handoffs, repairs: runs that ended so; tokens and cost per completed task (failed attempts '
    'included); operator interventions: cancels and manual retries. Compare two cohorts to judge a '
    'change to the fleet. Cost follows the cohort''s size (tasks_created, runs_started or runs_task).';

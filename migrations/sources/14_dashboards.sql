-- The operator's views: one row per lane, stuck task, session, repair, dead letter, hour, day, pool.
--
-- Every view is security_invoker: it reads the tables as its caller, through their row policies,
-- so a key limited to some lanes gets the rows of its lanes and figures counted from them alone
-- (02_security.sql). Every view is read-only: SELECT is its only grant, and its read_only trigger
-- makes a write a privilege error (42501) instead of "cannot update view" (55000).
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- The journal: every transition of every task, in the order it happened. What a row records is
-- written once, in that row, and read back here as the entry it is: a task's creation (the task
-- row: enqueued), a claim (its run's start: claimed) and a completion (its run's end: completed);
-- everything else is a row of fleet.events (repairs, hand-offs, cancels, throttles, routes, batch
-- steps, …). One sequence (the events' ids) numbers them all: id is the entry's position.
--
-- fleet.journal_since(p_since) holds the one definition of the entries, from p_since on (events_ts,
-- tasks_created, runs_lane_started lane by lane, fleet._runs_ended_since); fleet.journal is all of
-- it. Both are inlined into the caller's plan, so a task's entries (task_id: events_task, tasks_pkey, runs_task)
-- and a session's (session_id: events_session, runs_session) are index reads. Invoker: the rows of
-- the caller's lanes.
create or replace function fleet.journal_since(p_since timestamptz)
returns table (id bigint, ts timestamptz, kind text, lane text, task_id bigint, session_id uuid, detail jsonb)
language sql
stable
as $$
    select e.id, e.ts, e.kind, e.lane, e.task_id, e.session_id, e.detail
      from fleet.events e
     where e.ts >= p_since
    union all
    select t.journal_id, t.created_at, 'enqueued', coalesce(t.stages -> 0 ->> 'lane', t.lane), t.id, null::uuid,
           jsonb_strip_nulls(jsonb_build_object('key', t.key, 'priority', t.priority, 'profile', t.profile))
      from fleet.tasks t
     where t.created_at >= p_since
       -- (a routed task's row is its lane's now: the lane it entered, where its creation is an
       -- entry, is read as the row policies read a row's lane)
       and ((select fleet._allowed_lanes()) is null
            or coalesce(t.stages -> 0 ->> 'lane', t.lane) = any ((select fleet._allowed_lanes())::text[]))
    union all
    select r.start_id, r.started_at, 'claimed', r.lane, r.task_id, r.session_id,
           jsonb_strip_nulls(jsonb_build_object('attempt', r.attempt, 'tier', r.tier, 'profile', r.profile,
                                                'pool', r.pool)) || coalesce(r.claim_detail, '{}')
      from fleet.runs r
     where r.start_id is not null and r.started_at >= p_since
       and r.lane = any (array(select l.name from fleet.lanes l))
    union all
    select r.end_id, r.ended_at, 'completed', r.lane, r.task_id, r.session_id,
           jsonb_build_object('attempt', r.attempt, 'state', r.end_state)
      from fleet._runs_ended_since(p_since) r
     where r.end_id is not null and r.outcome = 'done';
$$;
comment on function fleet.journal_since(timestamptz) is
    'The journal''s entries from p_since on, in no order (order by id): as fleet.journal.';
revoke all on function fleet.journal_since(timestamp with time zone) from public;
grant execute on function fleet.journal_since(timestamp with time zone) to fleet_operator, fleet_worker, service_role;

create or replace view fleet.journal with (security_invoker = true) as
select j.id, j.ts, j.kind, j.lane, j.task_id, j.session_id, j.detail from fleet.journal_since('-infinity') j;
comment on view fleet.journal is
    'Every transition, in order (id): the events, and what the rows record once — a task''s creation '
    '(enqueued: its key, priority and profile, which never change), a claim''s run start (claimed) and '
    'a completed run''s end (completed: the state the task went to).';
comment on column fleet.journal.id is 'the entry''s position: one sequence orders every entry';
comment on column fleet.journal.ts is 'when (the time of the transaction that wrote it)';
comment on column fleet.journal.kind is 'what happened: enqueued, claimed, completed, or an event''s kind';
comment on column fleet.journal.lane is 'the lane it happened in';
comment on column fleet.journal.task_id is 'the task (NULL: an event of a lane or a session)';
comment on column fleet.journal.session_id is 'the shift''s session, where one took part';
comment on column fleet.journal.detail is 'what the entry says besides';
-- (a worker key reads it as it reads fleet.events and the rows it is made of: its lanes' rows)
revoke all on fleet.journal from service_role;
grant select on fleet.journal to fleet_operator, fleet_worker, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.journal
    for each row execute function fleet._read_only_view();

create or replace view fleet.lane_overview with (security_invoker = true) as
with outcomes as (
    -- the journal's last 24 h of outcomes per lane: the events (events_kind_ts: one range per
    -- kind; completed: a batch member's landing), and the claims' runs completed
    -- (fleet._runs_ended_since)
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
), completions as (
    select r.lane, count(*) as done_24h
      from fleet._runs_ended_since(now() - interval '24 hours') r
     where r.outcome = 'done' and r.end_id is not null
     group by r.lane
)
select l.name as lane,
       l.paused or l.paused_reason is not null as paused,
       q.queued,
       q.ready,
       q.queued - q.ready as scheduled,
       r.running,
       l.max_running as slots,
       case when l.max_running is not null then greatest(l.max_running - r.running, 0) end as idle_slots,
       round(extract(epoch from now() - q.oldest_ready_at), 1) as oldest_ready_seconds,
       coalesce(o.done_24h, 0) + coalesce(c.done_24h, 0) as done_24h,
       coalesce(o.failed_24h, 0) as failed_24h,
       coalesce(o.dead_24h, 0) as dead_24h,
       coalesce(o.cancelled_24h, 0) as cancelled_24h,
       coalesce(o.retries_24h, 0) as retries_24h,
       coalesce(o.handoffs_24h, 0) as handoffs_24h,
       coalesce(o.repairs_24h, 0) as repairs_24h,
       coalesce(o.operator_retries_24h, 0) as operator_retries_24h,
       s.active_sessions,
       h.created_at as last_handoff_at,
       g.blocked,
       g.in_review,
       (l.config ->> 'review_cap')::int as review_cap,
       g.needs_attention,
       sp.cost_usd as spent_today_usd,
       sp.tokens as spent_today_tokens,
       (l.config ->> 'daily_budget_usd')::numeric as daily_budget_usd,
       (l.config ->> 'daily_budget_tokens')::numeric as daily_budget_tokens,
       coalesce(sp.cost_usd >= (l.config ->> 'daily_budget_usd')::numeric, false)
           or coalesce(sp.tokens >= (l.config ->> 'daily_budget_tokens')::numeric, false) as over_budget,
       l.paused_reason,
       l.retired_at is not null as retired
  from fleet.lanes l
  -- queued rows of the lane: tasks_ready (partial, queued only)
  cross join lateral (
        select count(*) as queued,
               count(*) filter (where t.run_at <= now()) as ready,
               min(t.run_at) filter (where t.run_at <= now()) as oldest_ready_at
          from fleet.tasks t
         where t.lane = l.name and t.state = 'queued') q
  -- running rows of the lane: tasks_live_lane
  cross join lateral (
        select count(*) as running from fleet.tasks t where t.lane = l.name and t.state = 'running') r
  cross join lateral (
        select count(*) as active_sessions
          from fleet.sessions s where s.lane = l.name and s.state = 'active') s
  left join lateral (
        select h.created_at from fleet.lane_handoffs h where h.lane = l.name order by h.id desc limit 1) h
    on true
  left join outcomes o on o.lane = l.name
  left join completions c on c.lane = l.name
  -- waiting for people: blocked, in review (tasks_live_lane), agents waiting on a prompt
  cross join lateral (
        select count(*) filter (where t.state = 'blocked') as blocked,
               count(*) filter (where t.state = 'review') as in_review,
               count(*) filter (where t.state = 'running' and t.attention is not null) as needs_attention
          from fleet.tasks t
         where t.lane = l.name and t.state in ('blocked', 'review', 'running')) g
  cross join lateral fleet._lane_spend_today(l.name) sp
 order by l.name;
comment on view fleet.lane_overview is
    'One row per lane: what waits, what runs, free slots, and the outcomes of the last 24 h '
    '(from the journal). Reads the live rows through the partial indexes and 24 h of the journal.';
comment on column fleet.lane_overview.lane is 'the lane';
comment on column fleet.lane_overview.paused is
    'the lane is paused (by the operator in fleet.toml, or by lanefleet: paused_reason): nothing is claimed';
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
comment on column fleet.lane_overview.blocked is 'tasks blocked until an operator acts (fleet resume / retry)';
comment on column fleet.lane_overview.in_review is 'completed tasks waiting for review (fleet review approve|reject)';
comment on column fleet.lane_overview.needs_attention is 'running agents waiting on a question or a permission prompt';
comment on column fleet.lane_overview.over_budget is 'the lane spent its daily budget: no claims until the next UTC day';
comment on column fleet.lane_overview.paused_reason is
    'what lanefleet found wrong with the lane''s config (its preflight, an agent program that could not start): '
    'the lane is paused until `fleet lanes sync` of a fixed config; NULL for an operator''s pause';
comment on column fleet.lane_overview.retired is 'retired (`fleet lanes retire`): takes no tasks, never claimed';
comment on column fleet.lane_overview.review_cap is 'the lane''s review_cap: no claims while this many tasks wait in review (NULL: no cap)';
comment on column fleet.lane_overview.spent_today_usd is 'cost of the lane''s runs started since midnight UTC';
comment on column fleet.lane_overview.spent_today_tokens is 'tokens (every kind) of the lane''s runs started since midnight UTC';
comment on column fleet.lane_overview.daily_budget_usd is 'the lane''s daily cost budget (NULL: none)';
comment on column fleet.lane_overview.daily_budget_tokens is 'the lane''s daily token budget (NULL: none)';
revoke all on fleet.lane_overview from service_role;
grant select on fleet.lane_overview to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.lane_overview
    for each row execute function fleet._read_only_view();

create or replace view fleet.stuck_tasks with (security_invoker = true) as
with running as (
    -- the running tasks (tasks_running_session), their open run and the start of their stage
    select t.id, t.lane, t.key, t.title, t.session_id, t.attempts,
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
), p95 as materialized (
    -- per lane with running work, once (not again for each running task): p95 stage wall-clock of
    -- its last 500 stages completed in 7 days (runs_lane_started, newest first: some 500 rows of the
    -- lane, whatever the history). A run ends after it starts, so one started in the 7 days ended in
    -- them: no test of ended_at beside (its estimate, multiplied with the start's as if the two were
    -- independent, made the planner expect a few dozen rows and sort the whole week instead)
    select rl.lane, count(*) as completed, percentile_cont(0.95) within group (order by c.seconds) as p95_seconds
      from (select distinct x.lane from running x) rl
      cross join lateral (
            select extract(epoch from r.ended_at - coalesce(fc.started_at, r.started_at)) as seconds
              from fleet.runs r
              left join lateral (
                    select r0.started_at from fleet.runs r0
                     where r.attempt > 1 and r0.task_id = r.task_id and r0.id < r.id
                       and r0.lane = r.lane and r0.attempt = 1
                     order by r0.id desc limit 1) fc on true
             where r.lane = rl.lane and r.started_at >= now() - interval '7 days'
               and r.outcome in ('done', 'routed')
             order by r.started_at desc
             limit 500) c
     group by rl.lane
), judged as (
    select x.*, s.host, s.pid, s.state as session_state, s.heartbeat_at,
           fleet._lease_until(s.heartbeat_at, x.lease_seconds, x.session_timeout) as lease_until,
           p.p95_seconds, p.completed,
           array_remove(array[
               case when fleet._lease_until(s.heartbeat_at, x.lease_seconds, x.session_timeout) < now()
                    then 'lease-expired'
                    when fleet._lease_until(s.heartbeat_at, x.lease_seconds, x.session_timeout)
                         < now() + least(interval '1 minute',
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
       j.lease_until as lease_expires_at,
       round(extract(epoch from j.lease_until - now()), 1) as lease_remaining_seconds,
       round(extract(epoch from now() - j.heartbeat_at), 1) as heartbeat_age_seconds,
       j.last_progress_at
  from judged j
 where cardinality(j.reasons) > 0
 order by j.stage_started_at, j.id;
comment on view fleet.stuck_tasks is
    'Running tasks that look stuck, with the reasons: lease expired or about to (less than '
    'min(1 minute, lease/3) left: two heartbeats missed), session lost, ended or silent, running longer '
    'than the lane''s p95 stage wall-clock (its last 500 stages in 7 days, at least 10), no progress for the lane''s '
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
    'p95 stage wall-clock of the lane''s last 500 stages completed in the last 7 days (NULL: none)';
comment on column fleet.stuck_tasks.lease_expires_at is
    'when the lease runs out unless the session heartbeats: its last heartbeat plus the lane''s lease';
comment on column fleet.stuck_tasks.lease_remaining_seconds is 'seconds left on the lease (negative: expired)';
comment on column fleet.stuck_tasks.heartbeat_age_seconds is 'seconds since the session''s last heartbeat';
comment on column fleet.stuck_tasks.last_progress_at is 'the last checkpoint (NULL: none yet)';
revoke all on fleet.stuck_tasks from service_role;
grant select on fleet.stuck_tasks to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.stuck_tasks
    for each row execute function fleet._read_only_view();

create or replace view fleet.session_overview with (security_invoker = true) as
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
revoke all on fleet.session_overview from service_role;
grant select on fleet.session_overview to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.session_overview
    for each row execute function fleet._read_only_view();

create or replace view fleet.recent_repairs with (security_invoker = true) as
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
revoke all on fleet.recent_repairs from service_role;
grant select on fleet.recent_repairs to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.recent_repairs
    for each row execute function fleet._read_only_view();

create or replace view fleet.dead_letters with (security_invoker = true) as
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
revoke all on fleet.dead_letters from service_role;
grant select on fleet.dead_letters to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.dead_letters
    for each row execute function fleet._read_only_view();

create or replace view fleet.throughput_hourly with (security_invoker = true) as
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
revoke all on fleet.throughput_hourly from service_role;
grant select on fleet.throughput_hourly to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.throughput_hourly
    for each row execute function fleet._read_only_view();

create or replace view fleet.usage_by_lane_day with (security_invoker = true) as
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
revoke all on fleet.usage_by_lane_day from service_role;
grant select on fleet.usage_by_lane_day to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.usage_by_lane_day
    for each row execute function fleet._read_only_view();

-- The capacity pools a key may read. Pools are shared by lanes: a key limited to some lanes gets
-- those its lanes draw from (named in a lane's dispatch or by its profile, or drawn by a running
-- task of its lanes), with the pool's own slots and throttle, but not its throttle note: that is a
-- line of the output of whichever lane's run hit the limit (a key finds its own lanes' in their
-- throttled events). Security definer: fleet.pools itself shows a row only to a key of every lane
-- (its row policy), since row policies cannot hide one column.
-- (rows 10, a row per pool: the planner's estimate of what it returns. The default of 1,000 for a set-returning
-- function made fleet.metrics() cost 12.5 M, above jit_above_cost: a server with JIT
-- compiled the scrape for 1.3 s at every call, for 3 ms of work.)
create or replace function fleet._pools_of_the_key()
returns table (name text, slots int, throttled_until timestamptz, throttle_note text)
language sql
stable
rows 10
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
    select p.name, p.slots, p.throttled_until, case when k.lanes is null then p.throttle_note end
      from fleet.pools p
     cross join (select fleet._allowed_lanes() as lanes) k
     where k.lanes is null
        or exists (select 1 from fleet.lanes l
                    where l.name = any (k.lanes)
                      and (l.config -> 'dispatch' @> jsonb_build_array(jsonb_build_object('pool', p.name))
                           or exists (select 1 from fleet.profiles pf
                                       where pf.name = l.config ->> 'profile' and pf.pool = p.name)))
        or exists (select 1 from fleet.tasks t
                    where t.state = 'running' and t.lane = any (k.lanes) and t.pool = p.name);
$$;
revoke all on function fleet._pools_of_the_key() from public;
grant execute on function fleet._pools_of_the_key() to fleet_operator, service_role;

create or replace view fleet.pool_overview with (security_invoker = true) as
select pl.name as pool,
       pl.slots,
       (select count(*) from fleet.tasks t where t.state = 'running' and t.pool = pl.name) as in_use,
       case when pl.throttled_until > now() then pl.throttled_until end as throttled_until,
       case when pl.throttled_until > now() then pl.throttle_note end as throttle_note,
       (select count(*) from fleet.events e
         where e.kind = 'throttled' and e.ts >= date_trunc('day', now())
           and e.detail ->> 'pool' = pl.name) as throttles_today,
       (select count(*) from fleet.runs r  -- (runs_pool_started)
         where r.pool = pl.name and r.started_at >= date_trunc('day', now())
           and (r.claim_detail ->> 'spilled')::boolean) as spillovers_today,
       (select string_agg(pf.name, ', ' order by pf.name) from fleet.profiles pf where pf.pool = pl.name) as profiles,
       (select count(*) from fleet.events e
         where e.kind = 'transient' and e.ts >= date_trunc('day', now())
           and e.detail ->> 'pool' = pl.name) as transients_today
  from fleet._pools_of_the_key() pl;
comment on view fleet.pool_overview is
    'One row per capacity pool: slots, in use, throttled until (a usage limit), throttles, '
    'spill-overs (claims that came to this pool because the lane''s first choice was throttled or '
    'full) and transient provider errors since midnight UTC. A key limited to some lanes sees the '
    'pools its lanes draw from, with the pool''s own slots and throttle, and counts of its lanes'' '
    'tasks and events only.';
comment on column fleet.pool_overview.pool is 'the capacity pool';
comment on column fleet.pool_overview.slots is 'agents at once across the fleet (NULL: unlimited)';
comment on column fleet.pool_overview.in_use is 'running tasks drawing from the pool';
comment on column fleet.pool_overview.throttled_until is 'a usage limit: no claims from the pool before this (NULL: not throttled)';
comment on column fleet.pool_overview.throttle_note is
    'the message that throttled it (NULL for a key limited to some lanes: it is the output of whichever lane hit the limit)';
comment on column fleet.pool_overview.throttles_today is 'usage limits hit since midnight UTC';
comment on column fleet.pool_overview.spillovers_today is 'claims since midnight UTC that came here because the lane''s first pool was throttled or full';
comment on column fleet.pool_overview.profiles is 'the profiles drawing from the pool';
comment on column fleet.pool_overview.transients_today is
    'transient provider errors (overloaded, 5xx, connection reset) retried since midnight UTC; '
    'neither failures nor throttles';
revoke all on fleet.pool_overview from service_role;
grant select on fleet.pool_overview to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.pool_overview
    for each row execute function fleet._read_only_view();

-- Per pool and UTC day: how the runs that drew from it ended. accept_rate = done / (done + failed
-- + blocked); hand-offs, throttles, transient provider errors and lost runs say nothing about the
-- work and are not counted.
create or replace view fleet.pool_accept_rate with (security_invoker = true) as
select r.pool,
       date_trunc('day', r.started_at) as day,
       count(*) as runs,
       count(*) filter (where r.outcome = 'done') as done,
       count(*) filter (where r.outcome in ('failed', 'dead')) as failed,
       count(*) filter (where r.outcome = 'blocked') as blocked,
       count(*) filter (where r.outcome = 'throttled') as throttled,
       round(count(*) filter (where r.outcome = 'done')::numeric
             / nullif(count(*) filter (where r.outcome in ('done', 'failed', 'dead', 'blocked')), 0), 3)
           as accept_rate,
       count(*) filter (where r.outcome = 'transient') as transient
  from fleet.runs r
 where r.pool is not null and r.started_at >= now() - interval '30 days'
 group by r.pool, date_trunc('day', r.started_at);
comment on view fleet.pool_accept_rate is
    'Per pool and UTC day (30 days): runs by outcome and the accept rate done / (done + failed + blocked).';
comment on column fleet.pool_accept_rate.pool is 'the capacity pool';
comment on column fleet.pool_accept_rate.day is 'the UTC day the runs started';
comment on column fleet.pool_accept_rate.runs is 'runs that drew from the pool';
comment on column fleet.pool_accept_rate.done is 'runs that completed';
comment on column fleet.pool_accept_rate.failed is 'runs that failed (or went to the dead letter)';
comment on column fleet.pool_accept_rate.blocked is 'runs whose task was blocked (gate could not judge, budget)';
comment on column fleet.pool_accept_rate.throttled is 'runs that hit a usage limit';
comment on column fleet.pool_accept_rate.accept_rate is 'done / (done + failed + blocked)';
comment on column fleet.pool_accept_rate.transient is
    'runs ended by a transient provider error (overloaded, 5xx, connection reset), retried without a failure';
revoke all on fleet.pool_accept_rate from service_role;
grant select on fleet.pool_accept_rate to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.pool_accept_rate
    for each row execute function fleet._read_only_view();

create or replace view fleet.blocked_tasks with (security_invoker = true) as
select t.id, t.lane, t.key, t.title, t.block_reason, t.tier, t.run_profile as profile,
       t.updated_at as blocked_at, right(t.last_error, 2000) as evidence
  from fleet.tasks t
 where t.state = 'blocked';
comment on view fleet.blocked_tasks is
    'Tasks waiting for an operator: `fleet resume TASK` (re-runs the verify gate) or `fleet retry TASK`.';
comment on column fleet.blocked_tasks.id is 'the task';
comment on column fleet.blocked_tasks.lane is 'its lane';
comment on column fleet.blocked_tasks.key is 'its key';
comment on column fleet.blocked_tasks.title is 'its title';
comment on column fleet.blocked_tasks.block_reason is 'automation-broken, capability-unavailable (its verify gate) or budget';
comment on column fleet.blocked_tasks.tier is 'the tier of its next attempt';
comment on column fleet.blocked_tasks.profile is 'the profile of its last attempt';
comment on column fleet.blocked_tasks.blocked_at is 'when it was blocked';
comment on column fleet.blocked_tasks.evidence is 'the gate''s output tail or the budget it spent';
revoke all on fleet.blocked_tasks from service_role;
grant select on fleet.blocked_tasks to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.blocked_tasks
    for each row execute function fleet._read_only_view();

create or replace view fleet.attention_tasks with (security_invoker = true) as
select t.id, t.lane, t.key, t.attention, t.attention_at, s.host, s.pid
  from fleet.tasks t
  join fleet.sessions s on s.id = t.session_id
 where t.state = 'running' and t.attention is not null;
comment on view fleet.attention_tasks is
    'Running agents waiting on a question or a permission prompt: needs-attention, not progress.';
comment on column fleet.attention_tasks.id is 'the task';
comment on column fleet.attention_tasks.lane is 'its lane';
comment on column fleet.attention_tasks.key is 'its key';
comment on column fleet.attention_tasks.attention is 'what its agent waits for';
comment on column fleet.attention_tasks.attention_at is 'since when';
comment on column fleet.attention_tasks.host is 'the host of its shift';
comment on column fleet.attention_tasks.pid is 'the pid of its shift';
revoke all on fleet.attention_tasks from service_role;
grant select on fleet.attention_tasks to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.attention_tasks
    for each row execute function fleet._read_only_view();

create or replace view fleet.review_queue with (security_invoker = true) as
select t.id, t.lane, t.key, t.title, t.tier, t.run_profile as profile, t.pool, t.updated_at as since,
       left(t.result ->> 'summary', 500) as summary
  from fleet.tasks t
 where t.state = 'review';
comment on view fleet.review_queue is 'Completed tasks waiting for review, per lane (fleet review list).';
comment on column fleet.review_queue.id is 'the task';
comment on column fleet.review_queue.lane is 'its lane';
comment on column fleet.review_queue.key is 'its key';
comment on column fleet.review_queue.title is 'its title';
comment on column fleet.review_queue.tier is 'the tier it ran at';
comment on column fleet.review_queue.profile is 'the profile it ran with';
comment on column fleet.review_queue.pool is 'the pool it drew from';
comment on column fleet.review_queue.since is 'when it went to review';
comment on column fleet.review_queue.summary is 'the agent''s final message (its result summary)';
revoke all on fleet.review_queue from service_role;
grant select on fleet.review_queue to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.review_queue
    for each row execute function fleet._read_only_view();

-- Review outcomes of the last 30 days by lane, pool and host (the host of the shift whose run
-- completed the task): approved, rejected, accept rate = approved / (approved + rejected).
create or replace view fleet.review_accept_rate with (security_invoker = true) as
select e.lane,
       e.detail ->> 'pool' as pool,
       e.detail ->> 'host' as host,
       count(*) filter (where e.kind = 'review_approved') as approved,
       count(*) filter (where e.kind = 'review_rejected') as rejected,
       round(count(*) filter (where e.kind = 'review_approved')::numeric / nullif(count(*), 0), 3) as accept_rate
  from fleet.events e
 where e.kind in ('review_approved', 'review_rejected') and e.ts >= now() - interval '30 days'
 group by e.lane, e.detail ->> 'pool', e.detail ->> 'host';
comment on view fleet.review_accept_rate is
    'Review outcomes of 30 days per lane, pool and host: approved / (approved + rejected).';
comment on column fleet.review_accept_rate.lane is 'the lane';
comment on column fleet.review_accept_rate.pool is 'the pool the completing run drew from';
comment on column fleet.review_accept_rate.host is 'the host of the completing run''s shift';
comment on column fleet.review_accept_rate.approved is 'reviews approved in 30 days';
comment on column fleet.review_accept_rate.rejected is 'reviews rejected in 30 days';
comment on column fleet.review_accept_rate.accept_rate is 'approved / (approved + rejected)';
revoke all on fleet.review_accept_rate from service_role;
grant select on fleet.review_accept_rate to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.review_accept_rate
    for each row execute function fleet._read_only_view();

-- Per lane: tasks in every state, retries, hand-offs, tokens and cost (what `fleet up` prints).
-- p_key_prefix: only the tasks whose key starts with it and their runs, and only the lanes that have
-- any (`fleet up --demo`: its own run's summary, not the fleet's history).
-- Invoker: a caller sees the lanes RLS lets it read.
create or replace function fleet.lane_summary(p_key_prefix text default null)
returns table (lane text, queued bigint, running bigint, blocked bigint, review bigint, batched bigint,
               ci bigint, done bigint, dead bigint, cancelled bigint, retries bigint, handoffs bigint,
               tokens numeric, cost_usd numeric)
language sql
stable
as $$
    -- the tasks counted: every one, or those of the prefix
    with picked as (
        select t.* from fleet.tasks t
         where p_key_prefix is null or starts_with(t.key, p_key_prefix)
    ),
    -- what their runs spent, per lane of the run (a routed task's runs stay with their lanes)
    spent as (
        select r.lane, sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens) as tokens,
               sum(r.cost_usd) as cost_usd
          from fleet.runs r
         where p_key_prefix is null or r.task_id in (select id from picked)
         group by r.lane
    )
    select l.name,
           count(t.id) filter (where t.state = 'queued'),
           count(t.id) filter (where t.state = 'running'),
           count(t.id) filter (where t.state = 'blocked'),
           count(t.id) filter (where t.state = 'review'),
           count(t.id) filter (where t.state = 'batched'),
           count(t.id) filter (where t.state = 'ci'),
           count(t.id) filter (where t.state = 'done'),
           count(t.id) filter (where t.state = 'dead'),
           count(t.id) filter (where t.state = 'cancelled'),
           coalesce(sum(t.failures + t.evaporations), 0),
           coalesce(sum(t.handoffs), 0),
           coalesce(max(s.tokens), 0),
           coalesce(max(s.cost_usd), 0)
      from fleet.lanes l
      left join picked t on t.lane = l.name
      left join spent s on s.lane = l.name
     where p_key_prefix is null or t.id is not null or s.lane is not null
     group by l.name
     order by l.name;
$$;
revoke all on function fleet.lane_summary(text) from public;
grant execute on function fleet.lane_summary(text) to fleet_operator, service_role;

-- Ready tasks per lane whose claims may take them (the named query ready_by_lane), for `fleet up`
-- over REST. Invoker: RLS.
create or replace function fleet.ready_by_lane()
returns table (lane text, ready bigint)
language sql
stable
as $$
    select t.lane, count(*) from fleet.tasks t
     where t.state = 'queued' and t.run_at <= now()
       -- (a paused or retired lane has nothing a shift could claim)
       and exists (select 1 from fleet.lanes l where l.name = t.lane and fleet._lane_claimable(l))
     group by t.lane;
$$;
revoke all on function fleet.ready_by_lane() from public;
grant execute on function fleet.ready_by_lane() to fleet_operator, service_role;

-- fleet.batch_overview (11_batches.sql) is read-only too; its trigger stands here until its group
-- says it beside the view
create or replace trigger read_only instead of insert or update or delete on fleet.batch_overview
    for each row execute function fleet._read_only_view();

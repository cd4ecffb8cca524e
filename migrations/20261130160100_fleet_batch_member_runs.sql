-- lanefleet: a batch member's agent gets its own run, and the cohort figures split batched from
-- unbatched tasks (issue #10, item 6).
--
-- Until now a member's spend was summed into the carrier's run, so fleet.runs said what a batch
-- cost but not what each task cost, and the cohort figures counted carriers as tasks. Now the
-- member's agent is recorded as a run of the member's own task (closed when it is recorded: the
-- agent has exited; an open run would be a claim the monitor and the heartbeat look after), its
-- outcome following the member: done when it lands, failed when it is evicted, blocked while an
-- inconclusive gate holds the batch. The carrier's run carries what the carrier itself spends
-- (nothing of the members'). Then every figure read from fleet.runs — usage_by_lane_day,
-- cohort_metrics, budgets' task_spend — counts a member's tokens on the task that spent them.

------------------------------------------------------------------------------------------------
-- the member's run

alter table fleet.batch_members
    add column run_id bigint references fleet.runs (id) on delete set null;

comment on column fleet.batch_members.run_id is 'the run of the member''s agent (fleet.runs), once its agent exited';

create index batch_members_run on fleet.batch_members (run_id) where run_id is not null;

-- The usage a member's agent reported (the token and cost fields of a run report), checked:
-- an object whose counts are non-negative integers and whose cost is a non-negative number.
create or replace function fleet._batch_usage(p_usage jsonb)
returns jsonb
language plpgsql
immutable
as $$
declare
    k text;
begin
    if p_usage is null then
        return null;
    end if;
    if jsonb_typeof(p_usage) <> 'object' then
        perform fleet._raise('LF005', 'a member''s usage must be a JSON object',
            'input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens, cost_usd, model, agent_session');
    end if;
    foreach k in array array['input_tokens', 'cache_creation_tokens', 'cache_read_tokens', 'output_tokens', 'cost_usd'] loop
        if p_usage ? k and (jsonb_typeof(p_usage -> k) <> 'number' or (p_usage ->> k)::numeric < 0
                            or (k <> 'cost_usd' and (p_usage ->> k)::numeric <> trunc((p_usage ->> k)::numeric))) then
            perform fleet._raise('LF005', format('a member''s usage has a malformed %s: %s', k, p_usage -> k),
                'token counts are non-negative integers, cost_usd a non-negative number');
        end if;
    end loop;
    return p_usage;
end
$$;

-- Record or update the run of member m: with p_usage (its agent just exited) a closed run of the
-- member's task under the carrier's session is written once (a second report for the same member
-- adds nothing: a takeover re-runs the gate, never the agent); then its outcome, gate and reason
-- follow the member. Returns the run's id (null: the member's agent never reported).
create or replace function fleet._batch_member_run(b fleet.batches, m fleet.batch_members, p_usage jsonb,
                                                   p_outcome text, p_gate text, p_reason text default null)
returns bigint
language plpgsql
as $$
declare
    t fleet.tasks;
    c fleet.tasks;
    v_run bigint := m.run_id;
    u jsonb := fleet._batch_usage(p_usage);
begin
    if v_run is null and u is not null then
        select * into t from fleet.tasks where id = m.task_id;
        select * into c from fleet.tasks where id = b.task_id;
        update fleet.tasks set attempts = attempts + 1 where id = m.task_id
        returning attempts into t.attempts;
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, started_at, ended_at, outcome,
                                exit_code, tier, model, agent_session, profile, pool, reason, gate,
                                input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens, cost_usd,
                                log_path, error_tail)
        values (m.task_id, c.session_id, t.lane, t.attempts, gen_random_uuid(), coalesce(m.started_at, now()),
                now(), p_outcome, (u ->> 'exit_code')::int, t.tier, u ->> 'model', u ->> 'agent_session',
                coalesce(b.profile, c.run_profile), c.pool, p_reason, p_gate,
                coalesce((u ->> 'input_tokens')::bigint, 0), coalesce((u ->> 'cache_creation_tokens')::bigint, 0),
                coalesce((u ->> 'cache_read_tokens')::bigint, 0), coalesce((u ->> 'output_tokens')::bigint, 0),
                coalesce((u ->> 'cost_usd')::numeric, 0), u ->> 'log_path', left(u ->> 'error_tail', 4000))
        returning id into v_run;
        update fleet.batch_members
           set run_id = v_run,
               tokens = tokens + coalesce((u ->> 'input_tokens')::bigint, 0)
                               + coalesce((u ->> 'cache_creation_tokens')::bigint, 0)
                               + coalesce((u ->> 'cache_read_tokens')::bigint, 0)
                               + coalesce((u ->> 'output_tokens')::bigint, 0),
               cost_usd = cost_usd + coalesce((u ->> 'cost_usd')::numeric, 0)
         where batch_id = m.batch_id and n = m.n;
        if u ? 'agent_session' then  -- for an evicted member's next attempt, as record_run does
            update fleet.tasks set agent_session = u ->> 'agent_session' where id = m.task_id;
        end if;
    elsif v_run is not null then
        update fleet.runs
           set outcome = p_outcome, gate = coalesce(p_gate, gate), reason = coalesce(p_reason, reason)
         where id = v_run;
    end if;
    return v_run;
end
$$;

------------------------------------------------------------------------------------------------
-- the member steps, with the usage as a run report instead of a token total and a cost

drop function fleet.batch_member_gate(bigint, uuid, int, text, text, bigint, numeric);
drop function fleet.batch_member_landed(bigint, uuid, int, text, text, text, bigint, numeric);
drop function fleet.batch_member_evicted(bigint, uuid, int, text, text, bigint, numeric);

-- The member's gate state: 'pending' once its agent exited 0 (a takeover re-runs the gate, not
-- the agent; p_usage: the agent's report, which records the member's run), then the gate's
-- outcome.
create function fleet.batch_member_gate(p_carrier bigint, p_token uuid, p_n int, p_gate text,
                                        p_evidence text default null, p_usage jsonb default null)
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state <> 'running' then
        perform fleet._raise('LF004', format('member %s of batch %s is %s, not running', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set gate = p_gate, evidence = coalesce(right(p_evidence, 4000), evidence)
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, p_usage,
        case when p_gate in ('pending', 'ok') then 'done' else 'blocked' end,
        case when p_gate = 'pending' then null else p_gate end,
        case when p_gate in ('pending', 'ok') then null else p_gate end);
    return p_gate;
end
$$;

-- The member landed: the integration branch went p_from → p_to. Idempotent: a member landed
-- already is recorded once (the call after a crash between the push and this record answers
-- 'landed' and changes nothing). The member's task is done, its run too.
create function fleet.batch_member_landed(p_carrier bigint, p_token uuid, p_n int, p_from text, p_to text,
                                          p_gate text default 'ok')
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    t fleet.tasks;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state = 'landed' then
        return 'landed';
    end if;
    if m.state <> 'running' then
        perform fleet._raise('LF004', format('member %s of batch %s is %s: it cannot land', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set state = 'landed', head_sha = p_to, landed_from = p_from, landed_to = p_to, gate = p_gate, ended_at = now()
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, null, 'done', p_gate, null);
    select * into t from fleet.tasks where id = m.task_id for no key update;
    update fleet.tasks
       set state = 'done', finished_at = now(), updated_at = now(), batch_id = b.id,
           result = jsonb_build_object('batch', b.id, 'n', p_n, 'gate', p_gate, 'landed_from', p_from,
                                       'landed_to', p_to, 'branch', m.branch)
     where id = m.task_id;
    perform fleet._event('batch_landed', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'from', p_from, 'to', p_to));
    perform fleet._event('completed', t.lane, m.task_id, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'landed_to', p_to));
    return 'landed';
end
$$;

-- The member is evicted (its gate said task-failed, or its agent failed: then p_usage is the
-- agent's report): nothing of it landed. Its run failed; its task goes back to the queue as an
-- ordinary task with one more failure, or to the dead letter when that spends its cap.
-- Idempotent like the landing.
create function fleet.batch_member_evicted(p_carrier bigint, p_token uuid, p_n int, p_evidence text,
                                           p_gate text default 'task-failed', p_usage jsonb default null)
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    t fleet.tasks;
    v_state text;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state = 'evicted' then
        return 'evicted';
    end if;
    if m.state not in ('pending', 'running') then
        perform fleet._raise('LF004', format('member %s of batch %s is %s: it cannot be evicted', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set state = 'evicted', gate = p_gate, evidence = right(p_evidence, 4000), ended_at = now()
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, p_usage, 'failed', case when p_usage is null then p_gate end,
        case when p_usage is null then 'verify-failed' else 'agent-failed' end);
    select * into t from fleet.tasks where id = m.task_id for no key update;
    v_state := case when t.failures + 1 + t.evaporations >= fleet._cap(t) then 'dead' else 'queued' end;
    update fleet.tasks
       set state = v_state, batch_id = null, failures = failures + 1, updated_at = now(), run_at = now(),
           last_error = left(format('evicted from batch %s (%s): %s', b.id, p_gate, p_evidence), 4000),
           dead_reason = case when v_state = 'dead' then 'attempt-cap' else dead_reason end,
           finished_at = case when v_state = 'dead' then now() end
     where id = m.task_id;
    perform fleet._event('batch_evicted', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'gate', p_gate, 'to', v_state,
                           'evidence', right(p_evidence, 1000)));
    perform fleet._event('evicted', t.lane, m.task_id, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'gate', p_gate, 'to', v_state));
    return v_state;
end
$$;

------------------------------------------------------------------------------------------------
-- cohort_split: the cohort's figures for its batched and its unbatched tasks, side by side

create or replace function fleet.cohort_split(p_from timestamptz, p_to timestamptz, p_lane text default null,
                                              p_split boolean default true)
returns table (
    cohort text,
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
    cache_read_share numeric,
    cost_usd numeric,
    tokens_per_completed numeric,
    cost_per_completed numeric,
    batches bigint,
    batch_members bigint,
    evicted bigint,
    eviction_rate numeric,
    ship_runs bigint,
    ship_runs_per_completed numeric,
    blocks bigint,
    operator_cancels bigint,
    operator_retries bigint,
    operator_resumes bigint,
    interventions bigint)
language sql
stable
as $$
    with cohort as (
        -- the tasks queued in [p_from, p_to) (tasks_created), in p_lane if given: the lane they
        -- entered the fleet by (a routed task keeps its first lane in stages[0]). Carriers of
        -- batches are not tasks of a cohort. A task is batched when it was ever a member of a
        -- batch (a member released unrun from a cancelled batch is not).
        select t.id, t.state, t.finished_at,
               case when not p_split then 'all'
                    when exists (select 1 from fleet.batch_members bm where bm.task_id = t.id and bm.state <> 'released')
                    then 'batched' else 'unbatched' end as arm
          from fleet.tasks t
         where t.created_at >= p_from and t.created_at < p_to and t.kind = 'task'
           and (p_lane is null or coalesce(t.stages -> 0 ->> 'lane', t.lane) = p_lane)
    ), cohort_runs as (
        -- the runs of the cohort, every stage. A recent cohort: the runs started since p_from
        -- (runs_started; a task runs after it is queued) matched to the cohort's tasks by hash. An
        -- older one: looked up task by task (runs_task), so that its cost follows the cohort and
        -- not the runs of all the months since.
        select c.arm, r.task_id, r.started_at, r.outcome, r.input_tokens, r.cache_creation_tokens,
               r.cache_read_tokens, r.output_tokens, r.cost_usd
          from fleet.runs r
          join cohort c on c.id = r.task_id
         where p_from >= now() - interval '35 days'
           and r.started_at >= p_from
        union all
        select c.arm, r.*
          from cohort c
          cross join lateral (
                select r.task_id, r.started_at, r.outcome, r.input_tokens, r.cache_creation_tokens,
                       r.cache_read_tokens, r.output_tokens, r.cost_usd
                  from fleet.runs r where r.task_id = c.id
                offset 0) r  -- keeps the lookup per task (the planner would scan every run since)
         where p_from < now() - interval '35 days'
    ), per_task as (
        -- each task and its first claim
        select c.arm, c.id, c.state, c.finished_at, f.first_claim_at
          from cohort c
          left join (select task_id, min(started_at) as first_claim_at from cohort_runs group by task_id) f
            on f.task_id = c.id
    ), arms as (
        select 'all' as arm where not p_split
        union all select 'batched' where p_split
        union all select 'unbatched' where p_split
    ), run_totals as (
        select arm,
               count(*) as runs,
               count(*) filter (where outcome = 'failed') as failures,
               count(*) filter (where outcome = 'handed_off') as handoffs,
               count(*) filter (where outcome = 'lost') as repairs,
               coalesce(sum(input_tokens), 0) as input_tokens,
               coalesce(sum(cache_creation_tokens), 0) as cache_creation_tokens,
               coalesce(sum(cache_read_tokens), 0) as cache_read_tokens,
               coalesce(sum(output_tokens), 0) as output_tokens,
               coalesce(sum(cost_usd), 0) as cost_usd
          from cohort_runs
         group by arm
    ), members as (
        -- the cohort's batch memberships, and the batches they were in
        select c.arm, bm.batch_id, bm.task_id, bm.state
          from cohort c
          join fleet.batch_members bm on bm.task_id = c.id and bm.state <> 'released'
    ), batch_totals as (
        select arm, count(distinct batch_id) as batches, count(*) as members,
               count(*) filter (where state = 'evicted') as evicted
          from members
         group by arm
    ), task_events as (
        -- blocks and operator actions on the cohort's tasks (events_kind_ts: rare kinds, from p_from on)
        select c.arm, e.kind
          from fleet.events e
          join cohort c on c.id = e.task_id
         where e.kind in ('cancelled', 'retried', 'resumed', 'blocked') and e.ts >= p_from
    ), batch_events as (
        -- and on the carriers of their batches: a batch that is blocked, resumed or shipped counts
        -- once for the arm (a batch is an arm's unit of shipping and of blocking)
        select mb.arm, e.kind
          from (select distinct arm, batch_id from members) mb
          join fleet.batches b on b.id = mb.batch_id
          join fleet.events e on e.task_id = b.task_id
         where e.kind in ('batch_blocked', 'batch_resumed', 'batch_shipped', 'cancelled') and e.ts >= p_from
    ), event_totals as (
        select arm,
               count(*) filter (where kind = 'cancelled') as cancels,
               count(*) filter (where kind = 'retried') as retries,
               count(*) filter (where kind in ('resumed', 'batch_resumed')) as resumes,
               count(*) filter (where kind in ('blocked', 'batch_blocked')) as blocks,
               count(*) filter (where kind = 'batch_shipped') as ships
          from (select * from task_events union all select * from batch_events) x
         group by arm
    ), totals as (
        select arm,
               count(*) as tasks,
               count(*) filter (where p.state = 'done') as completed,
               count(*) filter (where p.state = 'dead') as dead,
               count(*) filter (where p.state = 'cancelled') as cancelled,
               count(*) filter (where p.state not in ('done', 'dead', 'cancelled')) as open,
               min(p.first_claim_at) as first_claim_at,
               max(p.finished_at) filter (where p.state in ('done', 'dead')) as last_finish_at,
               -- both percentiles from one sort
               percentile_cont(array[0.5, 0.95]) within group (
                   order by extract(epoch from p.finished_at - p.first_claim_at)::double precision)
                   filter (where p.state = 'done') as walls
          from per_task p
         group by arm
    )
    select a.arm, p_lane, p_from, p_to,
           coalesce(t.tasks, 0), coalesce(t.completed, 0), coalesce(t.dead, 0), coalesce(t.cancelled, 0),
           coalesce(t.open, 0),
           t.first_claim_at, t.last_finish_at,
           round(extract(epoch from t.last_finish_at - t.first_claim_at), 1),
           round(t.walls[1]::numeric, 1),
           round(t.walls[2]::numeric, 1),
           coalesce(u.runs, 0),
           round(coalesce(u.runs, 0)::numeric / nullif(t.tasks, 0), 2),
           coalesce(u.failures, 0), coalesce(u.handoffs, 0), coalesce(u.repairs, 0),
           coalesce(u.input_tokens, 0)::bigint, coalesce(u.cache_creation_tokens, 0)::bigint,
           coalesce(u.cache_read_tokens, 0)::bigint, coalesce(u.output_tokens, 0)::bigint,
           coalesce(u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens + u.output_tokens, 0)::bigint,
           round(u.cache_read_tokens::numeric
                 / nullif(u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens, 0), 4),
           coalesce(u.cost_usd, 0),
           round((u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens + u.output_tokens)::numeric
                 / nullif(t.completed, 0), 1),
           round(u.cost_usd / nullif(t.completed, 0), 6),
           coalesce(bt.batches, 0), coalesce(bt.members, 0), coalesce(bt.evicted, 0),
           round(bt.evicted::numeric / nullif(bt.members, 0), 4),
           coalesce(o.ships, 0),
           round(coalesce(o.ships, 0)::numeric / nullif(t.completed, 0), 4),
           coalesce(o.blocks, 0),
           coalesce(o.cancels, 0), coalesce(o.retries, 0), coalesce(o.resumes, 0),
           coalesce(o.cancels, 0) + coalesce(o.retries, 0) + coalesce(o.resumes, 0)
      from arms a
      left join totals t on t.arm = a.arm
      left join run_totals u on u.arm = a.arm
      left join batch_totals bt on bt.arm = a.arm
      left join event_totals o on o.arm = a.arm
     order by a.arm;
$$;

comment on function fleet.cohort_split(timestamptz, timestamptz, text, boolean) is
    'The figures of fleet.cohort_metrics for the batched and the unbatched tasks of a cohort apart (one row '
    'each; with p_split false one row, cohort ''all''): the A/B of running small tasks as batches, from SQL. '
    'A task is batched when it was ever a member of a batch (not one released unrun). Besides the cohort '
    'figures: cache_read_share = cache_read / (input + cache_creation + cache_read); batches, batch_members, '
    'evicted and eviction_rate (evicted / members); ship_runs (a batch''s `ship` command, once for the '
    'batched arm; lanefleet runs `ship` for batches only, so a single task''s shipping, inside its agent, '
    'is not counted), ship_runs_per_completed; blocks (a task''s '
    'or its batch''s blocked events); interventions = operator cancels + retries + resumes (`fleet '
    'resume`, of a task or of its batch).';

------------------------------------------------------------------------------------------------
-- cohort_metrics: the tasks of a cohort are work items, never the carriers of batches (a carrier
-- is a slot and a lease for its members; its members are counted, and since this migration spend
-- their own runs). Otherwise as in 20261130100300_fleet_views.sql.

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
    select s.lane, s.cohort_from, s.cohort_to, s.tasks, s.completed, s.dead, s.cancelled, s.open,
           s.first_claim_at, s.last_finish_at, s.makespan_seconds, s.wall_p50_seconds, s.wall_p95_seconds,
           s.runs, s.attempts_per_task, s.failures, s.handoffs, s.repairs, s.input_tokens,
           s.cache_creation_tokens, s.cache_read_tokens, s.output_tokens, s.total_tokens, s.cost_usd,
           s.tokens_per_completed, s.cost_per_completed, s.operator_cancels, s.operator_retries,
           s.operator_cancels + s.operator_retries
      from fleet.cohort_split(p_from, p_to, p_lane, false) s;
$$;

comment on function fleet.cohort_metrics(timestamptz, timestamptz, text) is
    'The figures of a cohort: the tasks queued in [p_from, p_to) (never the carriers of batches), '
    'optionally only those that entered the fleet in lane p_lane, counted over all their stages and runs '
    'up to now. completed/dead/cancelled/open: their states now; makespan: first claim -> last finish '
    '(done or dead); wall-clock: per completed task, first claim -> finish (p50, p95); attempts_per_task: '
    'runs / tasks; failures, handoffs, repairs: runs that ended so; tokens and cost per completed task '
    '(failed attempts included); operator interventions: cancels and manual retries. Compare two cohorts '
    'to judge a change to the fleet; fleet.cohort_split gives the same figures for batched and unbatched '
    'tasks apart. Cost follows the cohort''s size (tasks_created, runs_started or runs_task).';

------------------------------------------------------------------------------------------------
-- security: as in 20261130140000_fleet_batches.sql

do $$
declare
    f regprocedure;
begin
    foreach f in array array[
        'fleet.batch_member_gate(bigint, uuid, int, text, text, jsonb)',
        'fleet.batch_member_landed(bigint, uuid, int, text, text, text)',
        'fleet.batch_member_evicted(bigint, uuid, int, text, text, jsonb)']::regprocedure[]
    loop
        execute format('alter function %s security definer set search_path = pg_catalog, fleet, pg_temp', f);
    end loop;
end
$$;

revoke execute on function fleet._batch_usage(jsonb),
    fleet._batch_member_run(fleet.batches, fleet.batch_members, jsonb, text, text, text),
    fleet.batch_member_gate(bigint, uuid, int, text, text, jsonb),
    fleet.batch_member_landed(bigint, uuid, int, text, text, text),
    fleet.batch_member_evicted(bigint, uuid, int, text, text, jsonb),
    fleet.cohort_split(timestamptz, timestamptz, text, boolean)
    from public;
grant execute on function
    fleet.batch_member_gate(bigint, uuid, int, text, text, jsonb),
    fleet.batch_member_landed(bigint, uuid, int, text, text, text),
    fleet.batch_member_evicted(bigint, uuid, int, text, text, jsonb)
    to service_role, fleet_worker;
grant execute on function fleet.cohort_split(timestamptz, timestamptz, text, boolean) to service_role, fleet_operator;

notify pgrst, 'reload schema';

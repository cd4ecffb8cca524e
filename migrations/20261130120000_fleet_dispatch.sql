-- lanefleet: dispatch for coding agents (issue #8): model tiers and the escalation ladder,
-- dispatch profiles, verify gates (the `blocked` state), capacity pools and usage limits.
--
-- A lane's dispatch settings live in fleet.lanes.config (written by `fleet lanes sync` from
-- fleet.toml): tiers (in order, lowest first), default_tier, escalate_on (failure reasons that
-- move the next attempt one tier up), profile (the default profile) and dispatch (the lane's pools
-- in preference order, each with the profile that draws from it: [{"pool", "profile"}]).
-- Profiles and pools are fleet-wide and live in their own tables, so an unknown profile is refused
-- at enqueue and a pool's slots and throttle hold across lanes and hosts.

------------------------------------------------------------------------------------------------
-- tables

create table fleet.pools (
    name text primary key constraint pool_name check (name ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    slots int constraint pool_slots_non_negative check (slots is null or slots >= 0),  -- null: unlimited
    throttled_until timestamptz,   -- a usage limit: nothing is claimed from the pool before this
    throttle_note text,
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now()
);

create table fleet.profiles (
    name text primary key constraint profile_name check (name ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    pool text references fleet.pools (name) on update cascade,
    models jsonb not null default '{}' constraint profile_models_object check (jsonb_typeof(models) = 'object'),
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now()
);

alter table fleet.tasks
    add column tier text,              -- the tier the next (or current) attempt runs at
    add column profile text references fleet.profiles (name) on update cascade,  -- asked at enqueue
    add column run_profile text,       -- what the current (last) claim dispatched with
    add column pool text,              -- the pool the current (last) claim drew from
    add column block_reason text,      -- why a blocked task waits for an operator
    add column verify_pending boolean not null default false;  -- resumed: re-run the gate only

alter table fleet.tasks drop constraint task_state;
alter table fleet.tasks add constraint task_state
    check (state in ('queued', 'running', 'done', 'dead', 'cancelled', 'blocked'));
alter table fleet.tasks add constraint blocked_has_reason check ((state = 'blocked') = (block_reason is not null));

-- the pool slots of a claim: running tasks per pool
create index tasks_running_pool on fleet.tasks (pool) where state = 'running' and pool is not null;
create index tasks_blocked on fleet.tasks (lane) where state = 'blocked';

alter table fleet.runs
    add column profile text,
    add column pool text,
    add column reason text,            -- why a failed run failed (unverified-exit, verify-failed, ...)
    add column gate text;              -- the verify gate's outcome, when one ran

alter table fleet.runs drop constraint run_outcome;
alter table fleet.runs add constraint run_outcome check (outcome in
    ('done', 'failed', 'dead', 'handed_off', 'routed', 'lost', 'cancelled', 'blocked', 'throttled'));

create index runs_pool_started on fleet.runs (pool, started_at) where pool is not null;

------------------------------------------------------------------------------------------------
-- sync from fleet.toml (`fleet lanes sync`)

create or replace function fleet.sync_pool(p_name text, p_slots int)
returns text
language plpgsql
as $$
declare
    v_old fleet.pools;
begin
    if p_name is null or p_name !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a pool name', p_name),
            'lowercase letters, digits, - and _, 63 characters at most');
    end if;
    if p_slots is not null and p_slots < 0 then
        perform fleet._raise('LF005', format('pool %s: slots must be 0 or more, not %s', p_name, p_slots));
    end if;
    select * into v_old from fleet.pools where name = p_name for no key update;
    if not found then
        insert into fleet.pools (name, slots) values (p_name, p_slots);
        perform fleet._event('pool_created', null, null, null, jsonb_build_object('pool', p_name, 'slots', p_slots));
        return 'created';
    end if;
    if v_old.slots is not distinct from p_slots then
        return 'unchanged';
    end if;
    update fleet.pools set slots = p_slots, updated_at = now() where name = p_name;
    perform fleet._event('pool_updated', null, null, null, jsonb_build_object('pool', p_name, 'slots', p_slots));
    return 'updated';
end
$$;

create or replace function fleet.sync_profile(p_name text, p_pool text, p_models jsonb)
returns text
language plpgsql
as $$
declare
    v_old fleet.profiles;
begin
    if p_name is null or p_name !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a profile name', p_name),
            'lowercase letters, digits, - and _, 63 characters at most');
    end if;
    if p_models is null or jsonb_typeof(p_models) <> 'object' then
        perform fleet._raise('LF005', format('profile %s: models must be a JSON object (tier -> model)', p_name));
    end if;
    if p_pool is not null and not exists (select 1 from fleet.pools where name = p_pool) then
        perform fleet._raise('LF005', format('profile %s draws from unknown pool %L', p_name, p_pool),
            'sync the pool first');
    end if;
    select * into v_old from fleet.profiles where name = p_name for no key update;
    if not found then
        insert into fleet.profiles (name, pool, models) values (p_name, p_pool, p_models);
        perform fleet._event('profile_created', null, null, null,
            jsonb_build_object('profile', p_name, 'pool', p_pool, 'models', p_models));
        return 'created';
    end if;
    if (v_old.pool, v_old.models) is not distinct from (p_pool, p_models) then
        return 'unchanged';
    end if;
    update fleet.profiles set pool = p_pool, models = p_models, updated_at = now() where name = p_name;
    perform fleet._event('profile_updated', null, null, null,
        jsonb_build_object('profile', p_name, 'pool', p_pool, 'models', p_models));
    return 'updated';
end
$$;

------------------------------------------------------------------------------------------------
-- tiers

-- The lane's tiers, lowest first (empty: the lane has none).
create or replace function fleet._tiers(l fleet.lanes)
returns text[]
language sql
immutable
as $$
    select coalesce(array(select jsonb_array_elements_text(
                              case when jsonb_typeof(l.config -> 'tiers') = 'array' then l.config -> 'tiers' end)),
                    '{}');
$$;

-- The tier an attempt runs at: the task's, if the lane has it; else the lane's default tier.
create or replace function fleet._tier_for(l fleet.lanes, p_tier text)
returns text
language sql
immutable
as $$
    select case when p_tier = any (fleet._tiers(l)) then p_tier
                else coalesce(l.config ->> 'default_tier', (fleet._tiers(l))[1]) end;
$$;

------------------------------------------------------------------------------------------------
-- enqueue: with a tier and a profile (both optional, both checked now, never at run time)

drop function fleet.enqueue_after(double precision, text, text, jsonb, int, int, text);
drop function fleet.enqueue_task(text, text, jsonb, int, timestamptz, int, text);

-- (the new enqueue_task and enqueue_after, with tier, profile and a budget, are created by
-- 20261130130000_fleet_guardrails.sql)

------------------------------------------------------------------------------------------------
-- claim: pools and profiles
--
-- The claim that draws from pools is created once, with the guard rails' gates, by
-- 20261130130000_fleet_guardrails.sql: each task gets the first pool of its candidates that is
-- neither throttled nor full (the lane's pools in preference order, a spill-over when not the
-- first; a task enqueued with a profile, that profile's pool only), under the pools' row locks.

------------------------------------------------------------------------------------------------
-- fail: with a reason, and the escalation ladder

drop function fleet.fail(bigint, uuid, text, boolean);

create function fleet.fail(p_task bigint, p_token uuid, p_error text,
                           p_retryable boolean default true, p_reason text default null)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
    l fleet.lanes;
    v_reason text;
    v_delay numeric;
    v_tiers text[];
    v_at int;
    v_tier text;
begin
    t := fleet._fenced(p_task, p_token);
    select * into l from fleet.lanes where name = t.lane;
    if not coalesce(p_retryable, true) then
        v_reason := 'fatal';
    elsif t.failures + 1 + t.evaporations >= fleet._cap(t) then
        v_reason := 'attempt-cap';
    end if;

    -- one tier up for the next attempt when the lane escalates on this reason; the top tier stays
    v_tier := t.tier;
    if v_reason is null and p_reason is not null
       and p_reason = any (array(select jsonb_array_elements_text(
               case when jsonb_typeof(l.config -> 'escalate_on') = 'array' then l.config -> 'escalate_on'
                    else '["unverified-exit", "verify-failed", "stalled"]' end))) then
        v_tiers := fleet._tiers(l);
        v_at := array_position(v_tiers, fleet._tier_for(l, t.tier));
        if v_at is not null and v_at < cardinality(v_tiers) then
            v_tier := v_tiers[v_at + 1];
        end if;
    end if;

    if v_reason is not null then
        update fleet.tasks
           set state = 'dead', dead_reason = v_reason, failures = failures + 1, last_error = p_error,
               verify_pending = false, finished_at = now(), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    else
        v_delay := least(l.backoff_max_seconds::numeric,
                         l.backoff_base_seconds * power(2::numeric, least(t.failures, 30)));
        update fleet.tasks
           set state = 'queued', failures = failures + 1, last_error = p_error, tier = v_tier,
               verify_pending = false,
               run_at = now() + make_interval(secs => v_delay::double precision), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    end if;
    update fleet.runs set reason = p_reason where lease_token = p_token;
    perform fleet._end_run(p_token, 'failed', p_error);
    perform fleet._event('failed', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'error', left(p_error, 1000),
                           'retryable', coalesce(p_retryable, true), 'failure', p_reason,
                           'state', case when v_reason is null then 'queued' else 'dead' end,
                           'reason', v_reason, 'backoff_seconds', v_delay));
    if v_tier is distinct from t.tier then
        perform fleet._event('escalated', t.lane, p_task, t.session_id,
            jsonb_build_object('from', t.tier, 'to', v_tier, 'reason', p_reason, 'attempt', t.attempts));
    end if;
    return case when v_reason is null then 'queued' else 'dead' end;
end
$$;

------------------------------------------------------------------------------------------------
-- verify gates: a gate that could not judge blocks the task until an operator acts

-- Lock a task for an operator's transition, or raise: LF003 if there is no such task, LF008 if
-- the caller's key may not work its lane. (What cancel, retry, resume and the reviews share.)
create or replace function fleet._lock_task(p_task bigint)
returns fleet.tasks
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    select * into t from fleet.tasks where id = p_task for no key update;
    if not found then
        perform fleet._raise('LF003', format('unknown task %s', p_task));
    end if;
    perform fleet._require_lane(t.lane);
    return t;
end
$$;


create or replace function fleet.block(p_task bigint, p_token uuid, p_reason text, p_evidence text default null)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    if p_reason is null or p_reason !~ '^[a-z][a-z0-9-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a block reason', p_reason),
            'e.g. automation-broken, capability-unavailable, budget');
    end if;
    t := fleet._fenced(p_task, p_token);
    update fleet.tasks
       set state = 'blocked', block_reason = p_reason, last_error = coalesce(p_evidence, last_error),
           verify_pending = false, updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    update fleet.runs set reason = p_reason where lease_token = p_token;
    perform fleet._end_run(p_token, 'blocked', p_evidence);
    perform fleet._event('blocked', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'reason', p_reason, 'evidence', right(p_evidence, 1000)));
    return 'blocked';
end
$$;

-- An operator's answer to a blocked task: back to the queue. Blocked by its verify gate, the next
-- claim re-runs the gate only (the agent's work is already there); blocked for another reason
-- (a budget), the agent runs again.
create or replace function fleet.resume(p_task bigint)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    t := fleet._lock_task(p_task);
    if t.state <> 'blocked' then
        perform fleet._raise('LF004', format('task %s is %s: only blocked tasks can be resumed', p_task, t.state),
            'a dead or cancelled task is retried (`fleet retry`)');
    end if;
    update fleet.tasks
       set state = 'queued', run_at = now(), resume = true, updated_at = now(),
           verify_pending = t.block_reason in ('automation-broken', 'capability-unavailable'),
           block_reason = null
     where id = p_task;
    perform fleet._event('resumed', t.lane, p_task, null,
        jsonb_build_object('reason', t.block_reason,
                           'gate_only', t.block_reason in ('automation-broken', 'capability-unavailable')));
    return 'queued';
end
$$;

create or replace function fleet.retry(p_task bigint)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    t := fleet._lock_task(p_task);
    if t.state not in ('dead', 'cancelled', 'blocked') then
        perform fleet._raise('LF004',
            format('task %s is %s: only dead, cancelled or blocked tasks can be retried', p_task, t.state));
    end if;
    -- a fresh cap: the operator has decided it deserves more tries
    update fleet.tasks
       set state = 'queued', run_at = now(), failures = 0, evaporations = 0, handoffs = 0,
           dead_reason = null, block_reason = null, verify_pending = false,
           finished_at = null, resume = false, updated_at = now()
     where id = p_task;
    perform fleet._event('retried', t.lane, p_task, null,
        jsonb_build_object('was', t.state, 'reason', coalesce(t.dead_reason, t.block_reason)));
    return 'queued';
end
$$;

create or replace function fleet.cancel(p_task bigint)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    t := fleet._lock_task(p_task);
    if t.state = 'cancelled' then
        return 'cancelled';
    end if;
    if t.state not in ('queued', 'running', 'blocked') then
        perform fleet._raise('LF004',
            format('task %s is %s: only queued, running or blocked tasks can be cancelled', p_task, t.state));
    end if;
    update fleet.tasks
       set state = 'cancelled', finished_at = now(), updated_at = now(), resume = false,
           block_reason = null, verify_pending = false,
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    if t.state = 'running' then
        perform fleet._end_run(t.lease_token, 'cancelled');
    end if;
    perform fleet._event('cancelled', t.lane, p_task, t.session_id, jsonb_build_object('was', t.state));
    return 'cancelled';
end
$$;

------------------------------------------------------------------------------------------------
-- usage limits: never a success, never a spent attempt

-- The run hit its pool's usage or rate limit. The pool takes no claims until the reset: p_until
-- (a time the message named), else now() + p_after_seconds (a delay it named, or the profile's
-- backoff), else 15 minutes from now. The task goes back to the queue, first of its priority once
-- the reset has come, with its agent session kept, and no failure counted. Returns the reset.
create or replace function fleet.throttle(p_task bigint, p_token uuid, p_until timestamptz default null,
                                          p_note text default null, p_after_seconds double precision default null)
returns timestamptz
language plpgsql
as $$
declare
    t fleet.tasks;
    v_until timestamptz;
begin
    if p_after_seconds is not null and (p_after_seconds < 0 or p_after_seconds > 30 * 86400) then
        perform fleet._raise('LF005', format('a throttle delay must be 0 to 30 days, not %s s', p_after_seconds));
    end if;
    t := fleet._fenced(p_task, p_token);
    v_until := greatest(coalesce(p_until, now() + make_interval(secs => p_after_seconds),
                                 now() + interval '15 minutes'), now());
    if t.pool is not null then
        update fleet.pools
           set throttled_until = greatest(coalesce(throttled_until, v_until), v_until),
               throttle_note = left(p_note, 1000), updated_at = now()
         where name = t.pool;
    end if;
    update fleet.tasks
       set state = 'queued', run_at = v_until, resume = true, updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    update fleet.runs set reason = 'usage-limit' where lease_token = p_token;
    perform fleet._end_run(p_token, 'throttled', p_note);
    perform fleet._event('throttled', t.lane, p_task, t.session_id,
        jsonb_strip_nulls(jsonb_build_object('attempt', t.attempts, 'pool', t.pool, 'profile', t.run_profile,
                                             'until', v_until, 'note', left(p_note, 1000))));
    return v_until;
end
$$;

------------------------------------------------------------------------------------------------
-- record_run: also the verify gate's outcome (`gate`)

create or replace function fleet.record_run(p_token uuid, p_report jsonb)
returns void
language plpgsql
as $$
declare
    r fleet.runs;
    v_task bigint;
    v_lane text;
begin
    if p_report is null or jsonb_typeof(p_report) <> 'object' then
        perform fleet._raise('LF005', 'a run report must be a JSON object');
    end if;
    select task_id, lane into v_task, v_lane from fleet.runs where lease_token = p_token;
    if not found then
        perform fleet._raise('LF003', 'no run holds that lease token');
    end if;
    perform fleet._require_lane(v_lane);  -- the run's lane: the task may have been routed on since
    -- Lock order: the task, then its run, as every transition does (_fenced, cancel, _release lock
    -- the task and then end its run). Taking the run row first deadlocks against them.
    perform 1 from fleet.tasks where id = v_task for no key update;
    begin
        update fleet.runs
           set exit_code = coalesce((p_report ->> 'exit_code')::int, exit_code),
               tier = coalesce(p_report ->> 'tier', tier),
               model = coalesce(p_report ->> 'model', model),
               gate = coalesce(p_report ->> 'gate', gate),
               agent_session = coalesce(p_report ->> 'agent_session', agent_session),
               input_tokens = coalesce((p_report ->> 'input_tokens')::bigint, input_tokens),
               cache_creation_tokens = coalesce((p_report ->> 'cache_creation_tokens')::bigint, cache_creation_tokens),
               cache_read_tokens = coalesce((p_report ->> 'cache_read_tokens')::bigint, cache_read_tokens),
               output_tokens = coalesce((p_report ->> 'output_tokens')::bigint, output_tokens),
               cost_usd = coalesce((p_report ->> 'cost_usd')::numeric, cost_usd),
               log_path = coalesce(p_report ->> 'log_path', log_path),
               error_tail = coalesce(left(p_report ->> 'error_tail', 4000), error_tail)
         where lease_token = p_token
        returning * into r;
    exception when data_exception or check_violation then
        -- a count that is negative, fractional, not a number or too large
        perform fleet._raise('LF005', format('a run report has a malformed value: %s', sqlerrm),
            'token counts are non-negative integers, cost_usd a non-negative number, exit_code an integer');
    end;
    -- the agent's own session id, for the next attempt to resume, unless a later run took over
    -- or the task was routed on since (the next lane's stage starts without an agent session;
    -- the run row keeps it)
    if p_report ? 'agent_session' then
        update fleet.tasks t
           set agent_session = p_report ->> 'agent_session'
         where t.id = r.task_id
           and t.lane = r.lane
           and not exists (select 1 from fleet.runs later where later.task_id = r.task_id and later.id > r.id);
    end if;
end
$$;

------------------------------------------------------------------------------------------------
-- views

create view fleet.pool_overview as
select pl.name as pool,
       pl.slots,
       (select count(*) from fleet.tasks t where t.state = 'running' and t.pool = pl.name) as in_use,
       case when pl.throttled_until > now() then pl.throttled_until end as throttled_until,
       case when pl.throttled_until > now() then pl.throttle_note end as throttle_note,
       (select count(*) from fleet.events e
         where e.kind = 'throttled' and e.ts >= date_trunc('day', now())
           and e.detail ->> 'pool' = pl.name) as throttles_today,
       (select count(*) from fleet.events e
         where e.kind = 'claimed' and e.ts >= date_trunc('day', now())
           and e.detail ->> 'pool' = pl.name and (e.detail ->> 'spilled')::boolean) as spillovers_today,
       (select string_agg(pf.name, ', ' order by pf.name) from fleet.profiles pf where pf.pool = pl.name) as profiles
  from fleet.pools pl;

comment on view fleet.pool_overview is
    'One row per capacity pool: slots, in use, throttled until (a usage limit), throttles and '
    'spill-overs (claims that came to this pool because the lane''s first choice was throttled or '
    'full) since midnight UTC.';

-- Per pool and UTC day: how the runs that drew from it ended. accept_rate = done / (done + failed
-- + blocked); hand-offs, throttles and lost runs say nothing about the work and are not counted.
create view fleet.pool_accept_rate as
select r.pool,
       date_trunc('day', r.started_at) as day,
       count(*) as runs,
       count(*) filter (where r.outcome = 'done') as done,
       count(*) filter (where r.outcome in ('failed', 'dead')) as failed,
       count(*) filter (where r.outcome = 'blocked') as blocked,
       count(*) filter (where r.outcome = 'throttled') as throttled,
       round(count(*) filter (where r.outcome = 'done')::numeric
             / nullif(count(*) filter (where r.outcome in ('done', 'failed', 'dead', 'blocked')), 0), 3)
           as accept_rate
  from fleet.runs r
 where r.pool is not null and r.started_at >= now() - interval '30 days'
 group by r.pool, date_trunc('day', r.started_at);

comment on view fleet.pool_accept_rate is
    'Per pool and UTC day (30 days): runs by outcome and the accept rate done / (done + failed + blocked).';

create view fleet.blocked_tasks as
select t.id, t.lane, t.key, t.title, t.block_reason, t.tier, t.run_profile as profile,
       t.updated_at as blocked_at, right(t.last_error, 2000) as evidence
  from fleet.tasks t
 where t.state = 'blocked';

comment on view fleet.blocked_tasks is
    'Tasks waiting for an operator: `fleet resume TASK` (re-runs the verify gate) or `fleet retry TASK`.';

------------------------------------------------------------------------------------------------
-- security: as in 20261130100400_fleet_roles_rls.sql

do $$
declare
    f regprocedure;
begin
    for f in
        select p.oid::regprocedure
          from pg_catalog.pg_proc p
          join pg_catalog.pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet'
           and p.proname in ('enqueue_task', 'enqueue_after', 'claim', 'fail', 'block', 'resume',
                             'retry', 'cancel', 'throttle', 'sync_pool', 'sync_profile', 'record_run')
         order by p.oid
    loop
        execute format('alter function %s security definer set search_path = pg_catalog, fleet, pg_temp', f);
    end loop;
end
$$;

revoke execute on function fleet._lock_task from public;
grant execute on function fleet._lock_task to service_role;

revoke execute on function fleet.sync_pool, fleet.sync_profile, fleet._tiers, fleet._tier_for,
    fleet.fail, fleet.block, fleet.resume, fleet.throttle
    from public;
grant execute on function fleet.sync_pool, fleet.sync_profile, fleet._tiers, fleet._tier_for,
    fleet.fail, fleet.block, fleet.resume, fleet.throttle
    to service_role;
grant execute on function fleet.fail, fleet.block, fleet.throttle to fleet_worker;
grant execute on function fleet.resume to fleet_operator;

grant select on fleet.pools, fleet.profiles, fleet.pool_overview, fleet.pool_accept_rate, fleet.blocked_tasks
    to fleet_operator;
grant all on fleet.pools, fleet.profiles to service_role;

alter table fleet.pools enable row level security;
alter table fleet.profiles enable row level security;
create policy pools_service on fleet.pools to service_role using (true) with check (true);
create policy profiles_service on fleet.profiles to service_role using (true) with check (true);
create policy pools_operators on fleet.pools for select to fleet_operator using (true);
create policy profiles_operators on fleet.profiles for select to fleet_operator using (true);

notify pgrst, 'reload schema';

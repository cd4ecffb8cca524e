-- lanefleet: the SQL API (DESIGN §5). One function per transition, one transaction each, each
-- writing its fleet.events row. Every call that changes a running task carries its lease token and
-- goes through fleet._fenced(), so a stale token changes nothing.
--
-- Errors are raised with SQLSTATEs of class LF, which the Python store maps to exceptions:
--   LF001 lease lost         the token does not hold the task (it was repaired, re-claimed, cancelled…)
--   LF002 unknown lane
--   LF003 unknown task (or unknown run)
--   LF004 invalid state      the transition is not allowed from the task's current state
--   LF005 invalid argument
--   LF006 session not active unknown, ended or lost session
--   LF007 route refused      the target lane does not accept routes from this lane
--   LF008 lane not allowed   the caller's key may not work that lane (see fleet._allowed_lanes)
-- Time is always the database's now().

create or replace function fleet._raise(p_code text, p_message text, p_hint text default null)
returns void
language plpgsql
as $$
begin
    raise exception using errcode = p_code, message = p_message, hint = coalesce(p_hint, '');
end
$$;

-- Lane scoping (DESIGN §8). The lanes the caller may work; NULL means every lane. A key's JWT
-- names its lanes in the claim fleet_lanes (["docs", ...], "*" for all); PostgREST puts the
-- claims in request.jwt.claims and switches to the key's role (the setting `role`), which a
-- SECURITY DEFINER function still sees. Every lane: superusers, BYPASSRLS roles, service_role and
-- members of the owner of schema fleet (a direct connection as the migrator). An operator key
-- without fleet_lanes: every lane. Any other caller: only the lanes its claims list (none without).
create or replace function fleet._allowed_lanes()
returns text[]
language plpgsql
stable
as $$
declare
    v_role text := coalesce(nullif(nullif(current_setting('role', true), ''), 'none'), session_user);
    v_lanes jsonb;
begin
    if v_role = 'service_role'
       or exists (select 1 from pg_catalog.pg_roles r
                   where r.rolname = v_role and (r.rolsuper or r.rolbypassrls))
       or pg_catalog.pg_has_role(v_role, (select n.nspowner from pg_catalog.pg_namespace n
                                           where n.nspname = 'fleet'), 'MEMBER') then
        return null;
    end if;
    -- nullif: a pooled connection that once saw a request keeps the setting, as ''
    v_lanes := nullif(current_setting('request.jwt.claims', true), '')::jsonb -> 'fleet_lanes';
    if v_lanes is null then
        return case when v_role = 'fleet_operator' then null else '{}'::text[] end;
    end if;
    if jsonb_typeof(v_lanes) = 'string' then
        v_lanes := jsonb_build_array(v_lanes);
    end if;
    if jsonb_typeof(v_lanes) <> 'array' then
        return '{}'::text[];
    end if;
    if v_lanes ? '*' then
        return null;
    end if;
    return array(select jsonb_array_elements_text(v_lanes));
end
$$;

-- May the caller work lane p_lane? (NULL: every lane, for fleet-wide calls such as reconcile.)
create or replace function fleet._lane_allowed(p_lane text)
returns boolean
language sql
stable
as $$
    select a.lanes is null or (p_lane is not null and p_lane = any (a.lanes))
      from (select fleet._allowed_lanes() as lanes) a;
$$;

-- LF008 unless the caller may work lane p_lane. Called before a function writes anything.
create or replace function fleet._require_lane(p_lane text)
returns void
language plpgsql
as $$
begin
    if fleet._lane_allowed(p_lane) then
        return;
    end if;
    if p_lane is null then
        perform fleet._raise('LF008', 'this call works on every lane and this key is limited to some lanes',
            'use an operator key without fleet_lanes, or the service_role key');
    end if;
    perform fleet._raise('LF008', format('lane %L is not allowed for this key', left(p_lane, 100)),
        'the key''s fleet_lanes claim lists the lanes it may work; mint one with `fleet keys mint --lane`');
end
$$;

create or replace function fleet._event(p_kind text, p_lane text, p_task bigint, p_session uuid,
                                        p_detail jsonb default '{}')
returns void
language sql
as $$
    insert into fleet.events (kind, lane, task_id, session_id, detail)
    values (p_kind, p_lane, p_task, p_session, coalesce(p_detail, '{}'));
$$;

-- The lane row, or LF002 naming the lanes that do exist.
create or replace function fleet._lane(p_lane text)
returns fleet.lanes
language plpgsql
as $$
declare
    l fleet.lanes;
begin
    select * into l from fleet.lanes where name = p_lane;
    if not found then
        perform fleet._raise('LF002', format('unknown lane %L', p_lane),
            'known lanes: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.lanes), 'none')
            || '; run `fleet lanes sync` after adding it to fleet.toml');
    end if;
    return l;
end
$$;

-- Lock a running task whose lease p_token holds, or raise: LF003 if there is no such task,
-- LF001 ("lease lost") if the token does not hold it. The fence of every worker call.
create or replace function fleet._fenced(p_task bigint, p_token uuid)
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
    if t.state <> 'running' or p_token is null or t.lease_token <> p_token then
        perform fleet._raise('LF001',
            format('lease lost: task %s is %s and this lease no longer holds it', p_task, t.state));
    end if;
    return t;
end
$$;

-- Close the run row of a lease.
create or replace function fleet._end_run(p_token uuid, p_outcome text, p_error text default null)
returns void
language sql
as $$
    update fleet.runs
       set outcome = p_outcome,
           ended_at = now(),
           error_tail = coalesce(error_tail, left(p_error, 4000))
     where lease_token = p_token and ended_at is null;
$$;

-- The attempt cap of a task: its own, or its lane's.
create or replace function fleet._cap(t fleet.tasks)
returns int
language sql
stable
as $$
    select coalesce(t.max_attempts, (select max_attempts from fleet.lanes where name = t.lane));
$$;

------------------------------------------------------------------------------------------------
-- enqueue

create or replace function fleet.enqueue_task(
    p_lane text, p_key text, p_payload jsonb default '{}', p_priority int default 0,
    p_run_at timestamptz default now(), p_max_attempts int default null, p_title text default null)
returns table (task_id bigint, created boolean)
language plpgsql
as $$
#variable_conflict use_column
declare
    v_id bigint;
    v_lane text;
begin
    perform fleet._require_lane(p_lane);
    if p_key is null or length(p_key) = 0 or length(p_key) > 200 then
        perform fleet._raise('LF005', 'task key must be 1 to 200 characters');
    end if;
    perform fleet._lane(p_lane);
    if p_payload is not null and jsonb_typeof(p_payload) <> 'object' then
        perform fleet._raise('LF005',
            format('payload must be a JSON object, not a JSON %s', jsonb_typeof(p_payload)));
    end if;
    if p_priority is null or p_priority not between 0 and 1000 then
        perform fleet._raise('LF005', format('priority must be between 0 and 1000, not %s', p_priority),
            'higher runs first; the default is 0');
    end if;
    if p_max_attempts is not null and p_max_attempts < 1 then
        perform fleet._raise('LF005', format('max_attempts must be at least 1, not %s', p_max_attempts));
    end if;

    insert into fleet.tasks (lane, key, title, payload, priority, run_at, max_attempts)
    values (p_lane, p_key, p_title, coalesce(p_payload, '{}'), p_priority, coalesce(p_run_at, now()),
            p_max_attempts)
    on conflict (key) do nothing
    returning id into v_id;

    if v_id is null then
        select t.id, t.lane into v_id, v_lane from fleet.tasks t where t.key = p_key;
        perform fleet._require_lane(v_lane);  -- the key's task may be in a lane this caller may not see
        return query select v_id, false;
        return;
    end if;
    perform fleet._event('enqueued', p_lane, v_id, null,
        jsonb_build_object('key', p_key, 'priority', p_priority, 'run_at', coalesce(p_run_at, now())));
    return query select v_id, true;
end
$$;

comment on function fleet.enqueue_task is
    'enqueue, also saying whether the key was new (created) or already existed';

create or replace function fleet.enqueue(
    p_lane text, p_key text, p_payload jsonb default '{}', p_priority int default 0,
    p_run_at timestamptz default now(), p_max_attempts int default null, p_title text default null)
returns bigint
language sql
as $$
    select task_id from fleet.enqueue_task(p_lane, p_key, p_payload, p_priority, p_run_at,
                                           p_max_attempts, p_title);
$$;

comment on function fleet.enqueue is
    'queue a task; idempotent on key: the same key returns the existing id';

------------------------------------------------------------------------------------------------
-- sessions

create or replace function fleet.open_session(p_lane text, p_host text, p_pid int,
                                              p_pid_started_at timestamptz, p_seconds int)
returns uuid
language plpgsql
as $$
declare
    v_id uuid;
begin
    perform fleet._require_lane(p_lane);
    perform fleet._lane(p_lane);
    if p_host is null or p_host = '' then
        perform fleet._raise('LF005', 'host must not be empty');
    end if;
    if p_pid is null or p_pid <= 0 then
        perform fleet._raise('LF005', format('pid must be positive, not %s', p_pid));
    end if;
    if p_seconds is null or p_seconds <= 0 then
        perform fleet._raise('LF005', format('a session needs a positive length in seconds, not %s', p_seconds));
    end if;
    insert into fleet.sessions (lane, host, pid, pid_started_at, deadline)
    values (p_lane, p_host, p_pid, p_pid_started_at, now() + make_interval(secs => p_seconds))
    returning id into v_id;
    perform fleet._event('session_opened', p_lane, null, v_id,
        jsonb_build_object('host', p_host, 'pid', p_pid, 'seconds', p_seconds));
    return v_id;
end
$$;

-- The active session, locked, or LF006.
create or replace function fleet._active_session(p_session uuid)
returns fleet.sessions
language plpgsql
as $$
declare
    s fleet.sessions;
begin
    select * into s from fleet.sessions where id = p_session for no key update;
    if not found then
        perform fleet._raise('LF006', format('unknown session %s', p_session));
    end if;
    perform fleet._require_lane(s.lane);
    if s.state <> 'active' then
        perform fleet._raise('LF006',
            format('session %s is %s (%s); its tasks were released', p_session, s.state,
                   coalesce(s.end_reason, 'no reason given')));
    end if;
    return s;
end
$$;

------------------------------------------------------------------------------------------------
-- claim

create or replace function fleet.claim(p_session uuid, p_limit int default 1)
returns setof fleet.tasks
language plpgsql
as $$
declare
    s fleet.sessions;
    l fleet.lanes;
    v_free int;
begin
    if p_limit is null or p_limit < 0 then
        perform fleet._raise('LF005', format('claim limit must be 0 or more, not %s', p_limit));
    end if;
    s := fleet._active_session(p_session);
    update fleet.sessions set heartbeat_at = now() where id = s.id;
    -- Serialise the claims of one lane: the running count below must not change under us, or two
    -- claimers could each take the last free slot. NO KEY UPDATE leaves enqueue's FK lock free.
    select * into l from fleet.lanes where name = s.lane for no key update;
    if l.paused or p_limit = 0 or now() >= s.deadline then
        return;
    end if;
    v_free := p_limit;
    if l.max_running is not null then
        v_free := least(p_limit,
            l.max_running - (select count(*) from fleet.tasks where lane = s.lane and state = 'running'));
    end if;
    if v_free <= 0 then
        return;
    end if;

    return query
    with ready as (
        -- the next ready tasks of the lane, skipping rows another transaction holds
        -- (not a task this session handed off itself: a hand-off is for the next shift)
        select t.id, t.priority, t.resume, t.run_at
          from fleet.tasks t
         where t.lane = s.lane and t.state = 'queued' and t.run_at <= now()
           and not (t.resume and exists (select 1 from fleet.runs r
                                          where r.task_id = t.id and r.session_id = s.id
                                            and r.outcome = 'handed_off'))
         order by t.priority desc, t.resume desc, t.run_at, t.id
         limit v_free
           for update skip locked
    ), claimed as (
        -- lease them to the session
        update fleet.tasks t
           set state = 'running',
               attempts = t.attempts + 1,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => l.lease_seconds),
               session_id = s.id,
               resume = false,
               updated_at = now()
          from ready
         where t.id = ready.id
        returning t.*
    ), run_rows as (
        -- one run row per dispatch
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token)
        select c.id, s.id, c.lane, c.attempts, c.lease_token from claimed c
    ), journal as (
        insert into fleet.events (kind, lane, task_id, session_id, detail)
        select 'claimed', c.lane, c.id, s.id, jsonb_build_object('attempt', c.attempts) from claimed c
    )
    -- in the order they were picked (the claim clears resume, so order by ready's copy of it)
    select c.* from claimed c join ready r on r.id = c.id
     order by r.priority desc, r.resume desc, r.run_at, r.id;
end
$$;

------------------------------------------------------------------------------------------------
-- heartbeat

-- Renew the session and the leases of its tasks; one row per task: ok | lost | cancelled.
-- p_tasks: the tasks the shift is running. Given, only those are renewed, and a task the session
-- holds but the shift does not name (a claim whose answer was lost on the way, a final call the
-- shift gave up on) is released at once instead of being renewed forever. NULL: every task the
-- session holds is renewed, and runs ended by someone else since shortly before the last
-- heartbeat are reported.
create or replace function fleet.heartbeat(p_session uuid, p_tasks bigint[] default null)
returns table (task_id bigint, status text)
language plpgsql
as $$
#variable_conflict use_column
declare
    s fleet.sessions;
    v_lease int;
    v_since timestamptz;
    v_task bigint;
begin
    s := fleet._active_session(p_session);
    select lease_seconds into v_lease from fleet.lanes where name = s.lane;
    v_since := least(s.heartbeat_at, now()) - make_interval(secs => v_lease);
    update fleet.sessions set heartbeat_at = now() where id = s.id;

    if p_tasks is not null then
        for v_task in select t.id from fleet.tasks t
                       where t.session_id = s.id and t.state = 'running' and t.id <> all (p_tasks)
                       order by t.id
        loop
            perform fleet._release(v_task, 'not-run-by-shift');
        end loop;
    end if;

    return query
    with renewed as (
        update fleet.tasks t
           set lease_expires_at = now() + make_interval(secs => l.lease_seconds),
               updated_at = now()
          from fleet.lanes l
         where t.session_id = s.id and t.state = 'running' and l.name = t.lane
           and (p_tasks is null or t.id = any (p_tasks))
        returning t.id
    )
    select r.id, 'ok'::text from renewed r
    union all
    (select distinct on (r.task_id) r.task_id,
            case r.outcome when 'cancelled' then 'cancelled' else 'lost' end
       from fleet.runs r
      where r.session_id = s.id
        and r.task_id not in (select id from renewed)
        and case when p_tasks is null
                 then r.outcome in ('lost', 'cancelled') and r.ended_at >= v_since
                 else r.task_id = any (p_tasks) end
      -- one row per task: the outcome of its latest run in this session
      order by r.task_id, r.id desc);
end
$$;

------------------------------------------------------------------------------------------------
-- checkpoint, complete, fail, hand_off, route

create or replace function fleet.checkpoint(p_task bigint, p_token uuid, p_data jsonb)
returns int
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    if p_data is null then
        perform fleet._raise('LF005', 'checkpoint data must not be null');
    end if;
    t := fleet._fenced(p_task, p_token);
    update fleet.tasks
       set checkpoint = p_data, checkpoint_seq = checkpoint_seq + 1,
           last_progress_at = now(), updated_at = now()
     where id = p_task;
    perform fleet._event('checkpoint', t.lane, p_task, t.session_id,
        jsonb_build_object('seq', t.checkpoint_seq + 1));
    return t.checkpoint_seq + 1;
end
$$;

create or replace function fleet.complete(p_task bigint, p_token uuid, p_result jsonb default null)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    t := fleet._fenced(p_task, p_token);
    update fleet.tasks
       set state = 'done', result = p_result, finished_at = now(), updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'done');
    perform fleet._event('completed', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts));
    return 'done';
end
$$;

create or replace function fleet.fail(p_task bigint, p_token uuid, p_error text,
                                      p_retryable boolean default true)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
    l fleet.lanes;
    v_reason text;
    v_delay numeric;
begin
    t := fleet._fenced(p_task, p_token);
    select * into l from fleet.lanes where name = t.lane;
    if not coalesce(p_retryable, true) then
        v_reason := 'fatal';
    elsif t.failures + 1 + t.evaporations >= fleet._cap(t) then
        v_reason := 'attempt-cap';
    end if;

    if v_reason is not null then
        update fleet.tasks
           set state = 'dead', dead_reason = v_reason, failures = failures + 1, last_error = p_error,
               finished_at = now(), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    else
        v_delay := least(l.backoff_max_seconds::numeric,
                         l.backoff_base_seconds * power(2::numeric, least(t.failures, 30)));
        update fleet.tasks
           set state = 'queued', failures = failures + 1, last_error = p_error,
               run_at = now() + make_interval(secs => v_delay::double precision), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    end if;
    perform fleet._end_run(p_token, 'failed', p_error);
    perform fleet._event('failed', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'error', left(p_error, 1000),
                           'retryable', coalesce(p_retryable, true),
                           'state', case when v_reason is null then 'queued' else 'dead' end,
                           'reason', v_reason, 'backoff_seconds', v_delay));
    return case when v_reason is null then 'queued' else 'dead' end;
end
$$;

create or replace function fleet.hand_off(p_task bigint, p_token uuid, p_snapshot jsonb)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
    l fleet.lanes;
    v_state text;
begin
    if p_snapshot is not null and jsonb_typeof(p_snapshot) <> 'object' then
        perform fleet._raise('LF005', 'a hand-off snapshot must be a JSON object');
    end if;
    t := fleet._fenced(p_task, p_token);
    select * into l from fleet.lanes where name = t.lane;
    v_state := case when t.handoffs + 1 > l.max_handoffs then 'dead' else 'queued' end;
    update fleet.tasks
       set state = v_state,
           handoffs = handoffs + 1,
           handoff = coalesce(p_snapshot, '{}'),
           agent_session = coalesce(p_snapshot ->> 'agent_session', agent_session),
           resume = (v_state = 'queued'),
           run_at = now(),
           dead_reason = case when v_state = 'dead' then 'handoff-cap' end,
           finished_at = case when v_state = 'dead' then now() end,
           updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'handed_off');
    perform fleet._event('handed_off', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'handoffs', t.handoffs + 1, 'state', v_state));
    return v_state;
end
$$;

create or replace function fleet.route(p_task bigint, p_token uuid, p_lane text, p_note jsonb default null)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
    target fleet.lanes;
begin
    perform fleet._require_lane(p_lane);
    target := fleet._lane(p_lane);
    t := fleet._fenced(p_task, p_token);
    if target.name = t.lane then
        perform fleet._raise('LF005', format('task %s is already in lane %L; route to another lane', p_task, p_lane));
    end if;
    if target.accepts_from is not null and not (t.lane = any (target.accepts_from)) then
        perform fleet._raise('LF007', format('lane %L does not accept tasks routed from lane %L', p_lane, t.lane),
            'it accepts routes from: ' || coalesce(array_to_string(target.accepts_from, ', '), 'no lane'));
    end if;
    -- close this stage into the history; the next stage's counters start fresh
    update fleet.tasks
       set stages = stages || jsonb_build_array(jsonb_build_object(
               'lane', t.lane, 'attempts', t.attempts, 'failures', t.failures,
               'evaporations', t.evaporations, 'handoffs', t.handoffs,
               'agent_session', t.agent_session, 'checkpoint', t.checkpoint,
               'note', p_note, 'routed_to', p_lane, 'finished_at', now())),
           lane = p_lane, state = 'queued', run_at = now(), resume = false,
           attempts = 0, failures = 0, evaporations = 0, handoffs = 0,
           checkpoint = null, checkpoint_seq = 0, agent_session = null, handoff = null,
           last_error = null, updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'routed');
    perform fleet._event('routed', t.lane, p_task, t.session_id,
        jsonb_build_object('from', t.lane, 'to', p_lane, 'note', p_note));
    return 'queued';
end
$$;

------------------------------------------------------------------------------------------------
-- run accounting

-- What a run reported: exit code, model, tokens, cost, log. Keyed by the run's lease token and
-- allowed after the lease is gone: a fenced run still spent its tokens, and they must be counted.
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
-- repairs: a running task whose worker is gone goes back to the queue, or to the dead letter
-- when its cap is spent. Shared by close_session and reconcile.

create or replace function fleet._release(p_task bigint, p_reason text)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
    v_state text;
begin
    select * into t from fleet.tasks where id = p_task for no key update;
    if not found or t.state <> 'running' then
        return null;
    end if;
    v_state := case when t.failures + t.evaporations + 1 >= fleet._cap(t) then 'dead' else 'queued' end;
    update fleet.tasks
       set state = v_state,
           evaporations = evaporations + 1,
           run_at = now(),
           dead_reason = case when v_state = 'dead' then 'attempt-cap' end,
           finished_at = case when v_state = 'dead' then now() end,
           updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(t.lease_token, 'lost', 'released: ' || p_reason);
    perform fleet._event('repaired', t.lane, p_task, t.session_id,
        jsonb_build_object('reason', p_reason, 'state', v_state, 'attempt', t.attempts,
                           'evaporations', t.evaporations + 1,
                           'lease_expired_at', t.lease_expires_at));
    return v_state;
end
$$;

create or replace function fleet.close_session(p_session uuid, p_reason text, p_snapshot jsonb)
returns bigint
language plpgsql
as $$
declare
    s fleet.sessions;
    v_id bigint;
    v_task bigint;
begin
    if p_snapshot is not null and jsonb_typeof(p_snapshot) <> 'object' then
        perform fleet._raise('LF005', 'a lane hand-off snapshot must be a JSON object');
    end if;
    select * into s from fleet.sessions where id = p_session for no key update;
    if not found then
        perform fleet._raise('LF006', format('unknown session %s', p_session));
    end if;
    perform fleet._require_lane(s.lane);
    select id into v_id from fleet.lane_handoffs where session_id = p_session;
    if v_id is not null then
        return v_id;  -- closed already: closing again is a no-op
    end if;
    if s.state = 'active' then
        update fleet.sessions
           set state = 'ended', ended_at = now(), end_reason = coalesce(p_reason, 'closed')
         where id = p_session;
    end if;
    -- tasks the shift did not hand off are released (this counts against their cap)
    for v_task in select id from fleet.tasks where session_id = p_session and state = 'running' order by id
    loop
        perform fleet._release(v_task, 'session-closed');
    end loop;

    insert into fleet.lane_handoffs (lane, session_id, window_start, window_end, end_reason, counts,
                                     completed, failed, handed_off, tokens, cost_usd, notes, queue_head)
    select s.lane, s.id, s.started_at, now(), coalesce(p_reason, 'closed'),
           jsonb_build_object(
               'runs', count(r.id),
               'done', count(r.id) filter (where r.outcome = 'done'),
               'failed', count(r.id) filter (where r.outcome = 'failed'),
               'handed_off', count(r.id) filter (where r.outcome = 'handed_off'),
               'routed', count(r.id) filter (where r.outcome = 'routed'),
               'lost', count(r.id) filter (where r.outcome = 'lost'),
               'cancelled', count(r.id) filter (where r.outcome = 'cancelled')),
           coalesce(array_agg(r.task_id order by r.id) filter (where r.outcome = 'done'), '{}'),
           coalesce(array_agg(r.task_id order by r.id) filter (where r.outcome = 'failed'), '{}'),
           coalesce(array_agg(r.task_id order by r.id) filter (where r.outcome = 'handed_off'), '{}'),
           jsonb_build_object(
               'input', coalesce(sum(r.input_tokens), 0),
               'cache_creation', coalesce(sum(r.cache_creation_tokens), 0),
               'cache_read', coalesce(sum(r.cache_read_tokens), 0),
               'output', coalesce(sum(r.output_tokens), 0)),
           coalesce(sum(r.cost_usd), 0),
           coalesce(p_snapshot, '{}'),
           coalesce((select jsonb_agg(q) from (
                select t.id, t.key, t.title, t.priority, t.resume, t.run_at
                  from fleet.tasks t
                 where t.lane = s.lane and t.state = 'queued'
                 order by t.priority desc, t.resume desc, t.run_at, t.id
                 limit 10) q), '[]')
      from fleet.runs r
     where r.session_id = s.id
    returning id into v_id;

    perform fleet._event('session_closed', s.lane, null, s.id,
        jsonb_build_object('reason', coalesce(p_reason, 'closed'), 'lane_handoff', v_id));
    return v_id;
end
$$;

------------------------------------------------------------------------------------------------
-- operator calls

create or replace function fleet.cancel(p_task bigint)
returns text
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
    if t.state = 'cancelled' then
        return 'cancelled';
    end if;
    if t.state not in ('queued', 'running') then
        perform fleet._raise('LF004',
            format('task %s is %s: only queued or running tasks can be cancelled', p_task, t.state));
    end if;
    update fleet.tasks
       set state = 'cancelled', finished_at = now(), updated_at = now(), resume = false,
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    if t.state = 'running' then
        perform fleet._end_run(t.lease_token, 'cancelled');
    end if;
    perform fleet._event('cancelled', t.lane, p_task, t.session_id, jsonb_build_object('was', t.state));
    return 'cancelled';
end
$$;

create or replace function fleet.retry(p_task bigint)
returns text
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
    if t.state not in ('dead', 'cancelled') then
        perform fleet._raise('LF004',
            format('task %s is %s: only dead or cancelled tasks can be retried', p_task, t.state));
    end if;
    -- a fresh cap: the operator has decided it deserves more tries
    update fleet.tasks
       set state = 'queued', run_at = now(), failures = 0, evaporations = 0, handoffs = 0,
           dead_reason = null, finished_at = null, resume = false, updated_at = now()
     where id = p_task;
    perform fleet._event('retried', t.lane, p_task, null,
        jsonb_build_object('was', t.state, 'reason', t.dead_reason));
    return 'queued';
end
$$;

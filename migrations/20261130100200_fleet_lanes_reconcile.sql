-- lanefleet: lane sync and the monitor's repairs (DESIGN §7).

------------------------------------------------------------------------------------------------
-- lanes: written from fleet.toml by `fleet lanes sync` (and by migrate/up)

create or replace function fleet.sync_lane(p_name text, p_settings jsonb)
returns text
language plpgsql
as $$
declare
    v_known text[] := array['max_running', 'lease_seconds', 'max_attempts', 'max_handoffs',
        'session_timeout_seconds', 'backoff_base_seconds', 'backoff_max_seconds', 'accepts_from',
        'paused', 'config'];
    v_unknown text;
    v_old fleet.lanes;
    v_new fleet.lanes;
begin
    perform fleet._require_lane(p_name);
    if p_name is null or p_name !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a lane name', p_name),
            'lowercase letters, digits, - and _, 63 characters at most');
    end if;
    if p_settings is null or jsonb_typeof(p_settings) <> 'object' then
        perform fleet._raise('LF005', 'lane settings must be a JSON object');
    end if;
    select k into v_unknown from jsonb_object_keys(p_settings) k where k <> all (v_known) limit 1;
    if v_unknown is not null then
        perform fleet._raise('LF005', format('unknown lane setting %L', v_unknown),
            'known: ' || array_to_string(v_known, ', '));
    end if;
    select * into v_old from fleet.lanes where name = p_name for no key update;

    insert into fleet.lanes as l (name, max_running, lease_seconds, max_attempts, max_handoffs,
                                  session_timeout_seconds, backoff_base_seconds, backoff_max_seconds,
                                  accepts_from, paused, config)
    values (p_name,
            (p_settings ->> 'max_running')::int,
            coalesce((p_settings ->> 'lease_seconds')::int, 60),
            coalesce((p_settings ->> 'max_attempts')::int, 3),
            coalesce((p_settings ->> 'max_handoffs')::int, 10),
            (p_settings ->> 'session_timeout_seconds')::int,
            coalesce((p_settings ->> 'backoff_base_seconds')::int, 10),
            coalesce((p_settings ->> 'backoff_max_seconds')::int, 3600),
            case when jsonb_typeof(p_settings -> 'accepts_from') = 'array'
                 then array(select jsonb_array_elements_text(p_settings -> 'accepts_from')) end,
            coalesce((p_settings ->> 'paused')::boolean, false),
            coalesce(p_settings -> 'config', '{}'))
    on conflict (name) do update
       set max_running = excluded.max_running, lease_seconds = excluded.lease_seconds,
           max_attempts = excluded.max_attempts, max_handoffs = excluded.max_handoffs,
           session_timeout_seconds = excluded.session_timeout_seconds,
           backoff_base_seconds = excluded.backoff_base_seconds,
           backoff_max_seconds = excluded.backoff_max_seconds,
           accepts_from = excluded.accepts_from, paused = excluded.paused, config = excluded.config,
           updated_at = now()
    returning * into v_new;

    if v_old.name is null then
        perform fleet._event('lane_created', p_name, null, null, p_settings);
        return 'created';
    end if;
    if (v_old.max_running, v_old.lease_seconds, v_old.max_attempts, v_old.max_handoffs,
        v_old.session_timeout_seconds, v_old.backoff_base_seconds, v_old.backoff_max_seconds,
        v_old.accepts_from, v_old.paused, v_old.config)
       is not distinct from
       (v_new.max_running, v_new.lease_seconds, v_new.max_attempts, v_new.max_handoffs,
        v_new.session_timeout_seconds, v_new.backoff_base_seconds, v_new.backoff_max_seconds,
        v_new.accepts_from, v_new.paused, v_new.config) then
        return 'unchanged';
    end if;
    perform fleet._event('lane_updated', p_name, null, null, p_settings);
    return 'updated';
end
$$;

------------------------------------------------------------------------------------------------
-- the monitor

-- Declare a session lost and release every task it holds at once (not after their leases).
-- Returns one row per action. Shared by reconcile() and the host-local pid checks.
create or replace function fleet.declare_session_lost(p_session uuid, p_reason text)
returns table (action text, lane text, task_id bigint, session_id uuid, detail jsonb)
language plpgsql
as $$
#variable_conflict use_column
declare
    s fleet.sessions;
    v_task bigint;
    v_state text;
begin
    select * into s from fleet.sessions where id = p_session for no key update;
    if not found then
        perform fleet._raise('LF006', format('unknown session %s', p_session));
    end if;
    perform fleet._require_lane(s.lane);
    if s.state = 'active' then
        update fleet.sessions
           set state = 'lost', ended_at = now(), end_reason = coalesce(p_reason, 'lost')
         where id = p_session;
        perform fleet._event('session_lost', s.lane, null, s.id,
            jsonb_build_object('reason', coalesce(p_reason, 'lost'), 'heartbeat_at', s.heartbeat_at,
                               'host', s.host, 'pid', s.pid));
        action := 'session_lost'; lane := s.lane; task_id := null; session_id := s.id;
        detail := jsonb_build_object('reason', coalesce(p_reason, 'lost'), 'heartbeat_at', s.heartbeat_at,
                                     'host', s.host, 'pid', s.pid);
        return next;
    end if;
    for v_task in select t.id from fleet.tasks t where t.session_id = p_session and t.state = 'running'
                  order by t.id
    loop
        v_state := fleet._release(v_task, coalesce(p_reason, 'session-lost'));
        if v_state is not null then
            action := 'released'; lane := s.lane; task_id := v_task; session_id := s.id;
            detail := jsonb_build_object('reason', coalesce(p_reason, 'session-lost'), 'state', v_state);
            return next;
        end if;
    end loop;
end
$$;

-- One monitor pass. Under a transaction-scoped advisory lock: a second monitor running at the
-- same moment returns a single 'skipped' row and repairs nothing, so nothing is repaired twice.
-- Every query here reads only active sessions and running or ready tasks through partial
-- indexes: its cost follows the active work, not the history.
create or replace function fleet.reconcile(p_idle_seconds int default 300,
                                           p_overdue_grace_seconds int default 60)
returns table (action text, lane text, task_id bigint, session_id uuid, detail jsonb)
language plpgsql
as $$
#variable_conflict use_column
declare
    r record;
    v_state text;
begin
    perform fleet._require_lane(null);  -- a pass repairs every lane
    if not pg_try_advisory_xact_lock(7366104385829012) then
        action := 'skipped'; detail := jsonb_build_object('reason', 'another monitor is reconciling');
        return next;
        return;
    end if;

    -- 1. sessions that stopped heartbeating: lost, and their tasks released at once. The rows are
    --    locked here, so a heartbeat that commits meanwhile is seen (the condition is rechecked on
    --    the newest row) and a session busy in a call right now is left for the next pass.
    --    Ages count from the server's start at the earliest: while the database was down, no
    --    shift could heartbeat, and a restart must not make every live shift look dead.
    for r in
        select s.id
          from fleet.sessions s
          join fleet.lanes l on l.name = s.lane
         where s.state = 'active'
           and s.heartbeat_at < now() - make_interval(secs => coalesce(l.session_timeout_seconds, l.lease_seconds))
           and pg_postmaster_start_time() < now() - make_interval(secs => coalesce(l.session_timeout_seconds, l.lease_seconds))
         order by s.id
           for no key update of s skip locked
    loop
        return query select * from fleet.declare_session_lost(r.id, 'heartbeat-timeout');
    end loop;

    -- 2. tasks still held by a session that already ended (or was lost)
    for r in
        select t.id, t.lane, t.session_id, s.state as session_state
          from fleet.tasks t
          join fleet.sessions s on s.id = t.session_id
         where t.state = 'running' and s.state <> 'active'
         order by t.id
    loop
        v_state := fleet._release(r.id, 'session-ended');
        if v_state is not null then
            action := 'released'; lane := r.lane; task_id := r.id; session_id := r.session_id;
            detail := jsonb_build_object('reason', 'session-ended', 'state', v_state);
            return next;
        end if;
    end loop;

    -- 3. running tasks whose lease expired (a worker alive enough to heartbeat renews them);
    --    as above, a lease gets its full length after a server restart
    for r in
        select t.id, t.lane, t.session_id
          from fleet.tasks t
          join fleet.lanes l on l.name = t.lane
         where t.state = 'running' and t.lease_expires_at < now()
           and pg_postmaster_start_time() < now() - make_interval(secs => l.lease_seconds)
         order by t.lease_expires_at
           for no key update of t skip locked
    loop
        v_state := fleet._release(r.id, 'lease-expired');
        if v_state is not null then
            action := 'released'; lane := r.lane; task_id := r.id; session_id := r.session_id;
            detail := jsonb_build_object('reason', 'lease-expired', 'state', v_state);
            return next;
        end if;
    end loop;

    -- 4. sessions that outlived their deadline by more than the grace (reported once each)
    for r in
        select s.id, s.lane, s.deadline, s.host, s.pid
          from fleet.sessions s
         where s.state = 'active'
           and s.deadline < now() - make_interval(secs => p_overdue_grace_seconds)
           and not exists (select 1 from fleet.events e
                            where e.session_id = s.id and e.kind = 'session_overdue')
    loop
        action := 'overdue'; lane := r.lane; task_id := null; session_id := r.id;
        detail := jsonb_build_object('deadline', r.deadline, 'host', r.host, 'pid', r.pid);
        perform fleet._event('session_overdue', r.lane, null, r.id, detail);
        return next;
    end loop;

    -- 5. idle capacity ("leaked slot"): ready work waiting longer than p_idle_seconds in a lane
    --    with free slots and no active session (one event per lane per idle period)
    for r in
        select l.name, ready.n, ready.oldest, coalesce(running.n, 0) as running, l.max_running
          from fleet.lanes l
          cross join lateral (
                select count(*) as n, min(t.run_at) as oldest
                  from fleet.tasks t
                 where t.lane = l.name and t.state = 'queued' and t.run_at <= now()) ready
          left join lateral (
                select count(*) as n from fleet.tasks t where t.lane = l.name and t.state = 'running') running
            on true
         where not l.paused
           and ready.n > 0
           and ready.oldest < now() - make_interval(secs => p_idle_seconds)
           and (l.max_running is null or coalesce(running.n, 0) < l.max_running)
           and not exists (select 1 from fleet.sessions s where s.lane = l.name and s.state = 'active')
         order by l.name
    loop
        action := 'idle_capacity'; lane := r.name; task_id := null; session_id := null;
        detail := jsonb_build_object('ready', r.n, 'oldest_ready_at', r.oldest,
                                     'idle_seconds', extract(epoch from now() - r.oldest)::int,
                                     'running', r.running, 'max_running', r.max_running);
        if not exists (select 1 from fleet.events e
                        where e.kind = 'idle_capacity' and e.lane = r.name
                          and e.ts > now() - make_interval(secs => p_idle_seconds)) then
            perform fleet._event('idle_capacity', r.name, null, null, detail);
        end if;
        return next;
    end loop;

    -- 6. roll the hours that closed since the last pass into fleet.lane_hours, so the
    --    dashboards' 30-day views stay fast (defined with the views, in a later migration)
    if to_regprocedure('fleet.roll_up_lane_hours(integer)') is not null then
        perform fleet.roll_up_lane_hours();
    end if;
end
$$;

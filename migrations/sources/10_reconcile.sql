-- The monitor's pass: repair evaporated claims, report stalls.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet.reconcile(p_idle_seconds int default 300,
                                           p_overdue_grace_seconds int default 60)
returns table (action text, lane text, task_id bigint, session_id uuid, detail jsonb)
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
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
        -- (the running tasks whose session is not among the active ones: the planner reads the
        -- active sessions through their partial index instead of probing every running task's
        -- session in the whole history of sessions)
        select t.id, t.lane, t.session_id
          from fleet.tasks t
         where t.state = 'running'
           and not exists (select 1 from fleet.sessions s where s.id = t.session_id and s.state = 'active')
         order by t.id
    loop
        v_state := fleet._release(r.id, 'session-ended');
        if v_state is not null then
            action := 'released'; lane := r.lane; task_id := r.id; session_id := r.session_id;
            detail := jsonb_build_object('reason', 'session-ended', 'state', v_state);
            return next;
        end if;
    end loop;

    -- 3. running tasks whose lease ran out (fleet._lease_until: it follows the session, so this
    --    finds the tasks of a session silent for its lease that is not lost yet, with a session
    --    timeout longer than the lease); as above, a lease gets its full length after a server
    --    restart. The session rows are locked too: a heartbeat committed meanwhile is seen
    --    (rechecked on the newest row) and a session busy in a heartbeat is left for the next pass.
    for r in
        select t.id, t.lane, t.session_id
          from fleet.tasks t
          join fleet.sessions s on s.id = t.session_id and s.state = 'active'
          join fleet.lanes l on l.name = t.lane
         where t.state = 'running'
           and fleet._lease_until(s.heartbeat_at, l.lease_seconds, l.session_timeout_seconds) < now()
           and pg_postmaster_start_time() < now() - make_interval(secs => l.lease_seconds)
         order by s.heartbeat_at, t.id
           -- the session first: one busy in a heartbeat is skipped before any of its tasks is locked
           -- (a task locked and then skipped would stay locked, and that heartbeat would wait on it)
           for no key update of s, t skip locked
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
         where fleet._lane_claimable(l)
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
revoke all on function fleet.reconcile(integer,integer) from public;
grant execute on function fleet.reconcile(integer,integer) to fleet_operator, service_role;

-- reconcile's answer as one value (see fleet.enqueue_many_json): a JSON array of {action, lane,
-- task_id, session_id, detail} in the pass's order. A pass after an outage can repair more tasks
-- than PostgREST's db-max-rows lets through as rows.
create or replace function fleet.reconcile_json(p_idle_seconds int default 300,
                                                p_overdue_grace_seconds int default 60)
returns jsonb
language sql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
    select coalesce(jsonb_agg(jsonb_build_object('action', r.action, 'lane', r.lane, 'task_id', r.task_id,
                                                 'session_id', r.session_id, 'detail', r.detail) order by r.n), '[]')
      from fleet.reconcile(p_idle_seconds, p_overdue_grace_seconds)
           with ordinality r(action, lane, task_id, session_id, detail, n);
$$;
comment on function fleet.reconcile_json(integer, integer) is
    'fleet.reconcile with its answer as one JSON array of {action, lane, task_id, session_id, detail}, '
    'in order (one value: PostgREST''s db-max-rows does not cut it).';
revoke all on function fleet.reconcile_json(integer,integer) from public;
grant execute on function fleet.reconcile_json(integer,integer) to fleet_operator, service_role;

-- What the monitor reports each pass: running tasks without progress for their lane's
-- stall_seconds (liveness is not progress), and agents waiting on a prompt. Read only.
create or replace function fleet.stalled_tasks()
returns table (task_id bigint, lane text, session_id uuid, key text, quiet_seconds numeric,
               stall_seconds int, stall_action text, attention text)
language sql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
    select t.id, t.lane, t.session_id, t.key,
           round(extract(epoch from now() - t.last_progress_at)::numeric, 1),
           (l.config ->> 'stall_seconds')::int, coalesce(l.config ->> 'stall_action', 'report'), t.attention
      from fleet.tasks t
      join fleet.lanes l on l.name = t.lane
     where t.state = 'running' and fleet._lane_allowed(t.lane)
       and (t.attention is not null
            or ((l.config ->> 'stall_seconds') is not null
                and t.last_progress_at < now() - make_interval(secs => (l.config ->> 'stall_seconds')::double precision)))
     order by t.id;
$$;
revoke all on function fleet.stalled_tasks() from public;
grant execute on function fleet.stalled_tasks() to fleet_operator, service_role;

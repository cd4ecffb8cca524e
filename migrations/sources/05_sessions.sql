-- A shift's session: opened at start, closed with its hand-off, declared lost by a host.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet.open_session(p_lane text, p_host text, p_pid int,
                                              p_pid_started_at timestamptz, p_seconds int,
                                              p_pid_identity text default null)
returns uuid
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
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
    if length(p_pid_identity) not between 1 and 200 then
        perform fleet._raise('LF005', format('a process identity is 1 to 200 characters, not %s', length(p_pid_identity)));
    end if;
    insert into fleet.sessions (lane, host, pid, pid_started_at, pid_identity, deadline)
    values (p_lane, p_host, p_pid, p_pid_started_at, p_pid_identity, now() + make_interval(secs => p_seconds))
    returning id into v_id;
    perform fleet._event('session_opened', p_lane, null, v_id,
        jsonb_build_object('host', p_host, 'pid', p_pid, 'seconds', p_seconds));
    return v_id;
end
$$;
revoke all on function fleet.open_session(text,text,integer,timestamp with time zone,integer,text) from public;
grant execute on function fleet.open_session(text,text,integer,timestamp with time zone,integer,text) to fleet_worker, service_role;

create or replace function fleet.close_session(p_session uuid, p_reason text, p_snapshot jsonb)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    s fleet.sessions;
    v_id bigint;
    v_task bigint;
begin
    if p_snapshot is not null and jsonb_typeof(p_snapshot) <> 'object' then
        perform fleet._raise('LF005', 'a lane hand-off snapshot must be a JSON object');
    end if;
    s := fleet._lock_session(p_session);  -- another lane's session answers as an unknown one
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
                select t.id, t.key, t.title, t.priority, t.carry_over, t.run_at
                  from fleet.tasks t
                 where t.lane = s.lane and t.state = 'queued'
                 order by t.priority desc, t.carry_over desc, t.run_at, t.id
                 limit 10) q), '[]')
      from fleet.runs r
     where r.session_id = s.id
    returning id into v_id;

    perform fleet._event('session_closed', s.lane, null, s.id,
        jsonb_build_object('reason', coalesce(p_reason, 'closed'), 'lane_handoff', v_id));
    return v_id;
end
$$;
revoke all on function fleet.close_session(uuid,text,jsonb) from public;
grant execute on function fleet.close_session(uuid,text,jsonb) to fleet_worker, service_role;

-- Declare a session lost and release every task it holds at once (not after their leases).
-- Returns one row per action. Shared by reconcile() and the host-local pid checks.
create or replace function fleet.declare_session_lost(p_session uuid, p_reason text)
returns table (action text, lane text, task_id bigint, session_id uuid, detail jsonb)
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    s fleet.sessions;
    v_task bigint;
    v_state text;
begin
    s := fleet._lock_session(p_session);  -- another lane's session answers as an unknown one
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
revoke all on function fleet.declare_session_lost(uuid,text) from public;
grant execute on function fleet.declare_session_lost(uuid,text) to fleet_operator, fleet_worker, service_role;

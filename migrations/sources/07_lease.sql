-- What a running task's holder does while it runs: heartbeat, checkpoint, ask whether the lease holds.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- A shift's sign of life: one write to its session row renews the lease of every task it holds (a
-- task's lease follows its session, fleet._lease_until); task rows are written only where a task's
-- own state changes (released, progressed, waiting, stalled). Rows: first (NULL, 'session',
-- valid_for), then one per task: ok | lost | cancelled | stalled. valid_for: the seconds the lease
-- holds from the database's now() (0 for a task that is not held): the shift counts them from
-- before it sent the call, on its own monotonic clock, and stops its agents before they run out.
create or replace function fleet.heartbeat(p_session uuid, p_tasks bigint[] default null,
                                p_progressed bigint[] default null, p_attention jsonb default null)
returns table (task_id bigint, status text, valid_for double precision)
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    s fleet.sessions;
    l fleet.lanes;
    v_since timestamptz;
    v_valid double precision;
    v_task bigint;
    v_stalled bigint[] := '{}';
begin
    s := fleet._active_session(p_session);
    select * into l from fleet.lanes where name = s.lane;
    v_since := least(s.heartbeat_at, now()) - make_interval(secs => l.lease_seconds);
    update fleet.sessions set heartbeat_at = now() where id = s.id;
    v_valid := extract(epoch from fleet._lease_until(now(), l.lease_seconds, l.session_timeout_seconds) - now());

    if p_tasks is not null then
        for v_task in select t.id from fleet.tasks t
                       where t.session_id = s.id and t.state = 'running' and t.id <> all (p_tasks)
                       order by t.id
        loop
            perform fleet._release(v_task, 'not-run-by-shift');
        end loop;
    end if;

    -- progress the shift saw since its last heartbeat (checkpoint, log growth, agent hooks), and
    -- agents waiting on a question or a permission prompt ({"<task id>": "what it waits for"})
    if p_progressed is not null then
        update fleet.tasks t set last_progress_at = now()
         where t.session_id = s.id and t.state = 'running' and t.id = any (p_progressed);
    end if;
    if p_attention is not null and jsonb_typeof(p_attention) = 'object' then
        update fleet.tasks t
           set attention = left(p_attention ->> t.id::text, 500),
               attention_at = case when p_attention ? t.id::text
                                   then coalesce(case when t.attention is not null then t.attention_at end, now()) end
         where t.session_id = s.id and t.state = 'running'
           and (p_attention ? t.id::text or t.attention is not null);
    end if;
    -- stalls: alive but no progress for the lane's stall_seconds; where the lane says so
    -- (stall_action = stop) the attempt fails with reason stalled (escalating) and the shift is
    -- told to stop the agent
    for v_task in
        select t.id from fleet.tasks t join fleet.lanes l on l.name = t.lane
         where t.session_id = s.id and t.state = 'running'
           and l.config ->> 'stall_action' = 'stop' and (l.config ->> 'stall_seconds') is not null
           and (p_tasks is null or t.id = any (p_tasks))
           and coalesce(t.last_progress_at, now())
               < now() - make_interval(secs => (l.config ->> 'stall_seconds')::double precision)
           and t.attention is null  -- waiting on a human is not a stall
         order by t.id
    loop
        perform fleet.fail(v_task, (select lease_token from fleet.tasks where id = v_task),
            format('stalled: no progress for %s s (no checkpoint, no output, no hook)',
                   (select l.config ->> 'stall_seconds' from fleet.tasks t join fleet.lanes l on l.name = t.lane
                     where t.id = v_task)),
            true, 'stalled');
        v_stalled := v_stalled || v_task;
    end loop;

    return query select null::bigint, 'session'::text, v_valid;
    return query select x, 'stalled'::text, 0::double precision from unnest(v_stalled) x;
    return query
    with held as (
        select t.id from fleet.tasks t
         where t.session_id = s.id and t.state = 'running'
           and (p_tasks is null or t.id = any (p_tasks))
    )
    select h.id, 'ok'::text, v_valid from held h
    union all
    (select distinct on (r.task_id) r.task_id,
            case r.outcome when 'cancelled' then 'cancelled' else 'lost' end,
            0::double precision
       from fleet.runs r
      where r.session_id = s.id
        and r.task_id not in (select id from held)
        and r.task_id <> all (v_stalled)
        and case when p_tasks is null
                 then r.outcome in ('lost', 'cancelled') and r.ended_at >= v_since
                 else r.task_id = any (p_tasks) end
      -- one row per task: the outcome of its latest run in this session
      order by r.task_id, r.id desc);
end
$$;
revoke all on function fleet.heartbeat(uuid,bigint[],bigint[],jsonb) from public;
grant execute on function fleet.heartbeat(uuid,bigint[],bigint[],jsonb) to fleet_worker, service_role;

create or replace function fleet.checkpoint(p_task bigint, p_token uuid, p_data jsonb)
returns int
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
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
revoke all on function fleet.checkpoint(bigint,uuid,jsonb) from public;
grant execute on function fleet.checkpoint(bigint,uuid,jsonb) to fleet_worker, service_role;

-- Does p_token still hold task p_task, and for how long? held only if the task is running under
-- exactly that token, its session is active and its lease (fleet._lease_until: the session's last
-- heartbeat plus the lane's lease) has not run out by the database's clock (a lease that ran out but
-- was not repaired yet is not held: someone may repair it any moment). valid_for: the seconds it
-- still holds from the database's now() (0 when not held): `fleet guard` acts only if its own
-- round trip was shorter. `state` is the task's state, 'unknown' when there is no such task;
-- token_matches: the task runs under p_token, held or not (a lease that ran out unrepaired can
-- still be renewed by its shift; another token's cannot). A task of a lane the caller may not work
-- answers as one that does not exist ('unknown'). Read only.
create or replace function fleet.lease_held(p_task bigint, p_token uuid)
returns table (held boolean, state text, valid_for double precision, token_matches boolean)
language plpgsql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    v_until timestamptz;
begin
    select k.* into t from fleet.tasks k where k.id = p_task and fleet._lane_allowed(k.lane);
    if not found then
        return query select false, 'unknown'::text, 0::double precision, false;
        return;
    end if;
    if t.state = 'running' and p_token is not null and t.lease_token = p_token then
        select fleet._lease_until(s.heartbeat_at, l.lease_seconds, l.session_timeout_seconds) into v_until
          from fleet.sessions s join fleet.lanes l on l.name = s.lane
         where s.id = t.session_id and s.state = 'active';
    end if;
    return query
        select coalesce(v_until > now(), false), t.state::text,
               greatest(coalesce(extract(epoch from v_until - now()), 0), 0)::double precision,
               coalesce(t.state = 'running' and t.lease_token = p_token, false);
end
$$;
comment on function fleet.lease_held(bigint, uuid) is
    'fleet guard: (held, state, valid_for, token_matches): does the token still hold the running task, for how many more seconds, and is it still the task''s token (read only)';
revoke all on function fleet.lease_held(bigint,uuid) from public;
grant execute on function fleet.lease_held(bigint,uuid) to fleet_worker, service_role;

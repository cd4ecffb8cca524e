-- What a running task's holder does while it runs: heartbeat, checkpoint, ask whether the lease holds.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet.heartbeat(p_session uuid, p_tasks bigint[] default null,
                                p_progressed bigint[] default null, p_attention jsonb default null)
returns table (task_id bigint, status text)
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    s fleet.sessions;
    v_lease int;
    v_since timestamptz;
    v_task bigint;
    v_stalled bigint[] := '{}';
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

    return query select x, 'stalled'::text from unnest(v_stalled) x;
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

-- Does p_token still hold task p_task? True only if the task is running under exactly that token
-- and its lease has not expired by the database's clock (a lease the monitor has not repaired yet
-- but that ran out is not held: someone may repair it any moment). `state` is the task's state,
-- 'unknown' when there is no such task. LF008 if the caller may not work the task's lane.
create or replace function fleet.lease_held(p_task bigint, p_token uuid)
returns table (held boolean, state text)
language plpgsql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
begin
    select k.* into t from fleet.tasks k where k.id = p_task;
    if not found then
        return query select false, 'unknown'::text;
        return;
    end if;
    perform fleet._require_lane(t.lane);
    return query
        select coalesce(t.state = 'running' and p_token is not null and t.lease_token = p_token
                        and t.lease_expires_at > now(), false),
               t.state::text;
end
$$;
comment on function fleet.lease_held(bigint, uuid) is
    'fleet guard: (held, state): does the token still hold the running task, its lease unexpired (read only)';
revoke all on function fleet.lease_held(bigint,uuid) from public;
grant execute on function fleet.lease_held(bigint,uuid) to fleet_worker, service_role;

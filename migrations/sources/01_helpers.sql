-- Private helpers every group uses: errors, the journal, lane and session lookups, lease fencing.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet._raise(p_code text, p_message text, p_hint text default null)
returns void
language plpgsql
as $$
begin
    raise exception using errcode = p_code, message = p_message, hint = coalesce(p_hint, '');
end
$$;
revoke all on function fleet._raise(text,text,text) from public;
grant execute on function fleet._raise(text,text,text) to service_role;

create or replace function fleet._event(p_kind text, p_lane text, p_task bigint, p_session uuid,
                                        p_detail jsonb default '{}')
returns void
language plpgsql
as $$
begin
    insert into fleet.events (kind, lane, task_id, session_id, detail)
    values (p_kind, p_lane, p_task, p_session, coalesce(p_detail, '{}'));
end
$$;
revoke all on function fleet._event(text,text,bigint,uuid,jsonb) from public;
grant execute on function fleet._event(text,text,bigint,uuid,jsonb) to service_role;

-- The hint of an unknown lane: the lanes that exist and take tasks, of those the caller's key may
-- work (a lane-scoped key never learns the names of the others).
create or replace function fleet._lanes_hint()
returns text
language sql
stable
as $$
    select 'known lanes: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.lanes
                                         where fleet._lane_allowed(name) and retired_at is null), 'none')
           || '; run `fleet lanes sync` after adding it to fleet.toml';
$$;
revoke all on function fleet._lanes_hint() from public;
grant execute on function fleet._lanes_hint() to service_role;

-- The lane row, or LF002 naming the lanes that do exist (those the caller's key may work: a
-- lane-scoped key never learns the names of the others), or LF009 for a retired lane: what takes a
-- lane by name (enqueue, route, open_session, batch_create, retry) refuses a retired one. The row
-- is locked FOR KEY SHARE (what the foreign key of a new task takes anyway), so that
-- fleet.retire_lane, which locks it FOR UPDATE, waits for this transaction and then counts what it
-- wrote, or this one waits and reads the lane retired.
create or replace function fleet._lane(p_lane text)
returns fleet.lanes
language plpgsql
as $$
declare
    l fleet.lanes;
begin
    select * into l from fleet.lanes where name = p_lane for key share;
    if not found then
        perform fleet._raise('LF002', format('unknown lane %L', p_lane), fleet._lanes_hint());
    end if;
    if l.retired_at is not null then
        perform fleet._raise('LF009', format('lane %s is retired (since %s): it takes no tasks', p_lane,
                                             to_char(l.retired_at at time zone 'UTC', 'YYYY-MM-DD HH24:MI "UTC"')),
            format('`fleet lanes unretire %s` brings it back', p_lane));
    end if;
    return l;
end
$$;
revoke all on function fleet._lane(text) from public;
grant execute on function fleet._lane(text) to service_role;

-- LF008 unless the caller may work lane p_lane. Called before a function writes anything, on a
-- lane the caller named (an argument): the message names only what the caller gave. The lane of
-- an object the caller named by id (a task, a session, a workspace) is checked where the object is
-- looked up (fleet._lock_task, fleet._fenced, fleet._lock_session), so that another lane's object
-- answers exactly as one that does not exist.
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
revoke all on function fleet._require_lane(text) from public;
grant execute on function fleet._require_lane(text) to service_role;

-- Until when a running task's lease holds, by the database's clock: a task's lease follows its
-- session. The session's last sign of life (a heartbeat or a claim) plus the lane's lease, and not
-- past the moment the monitor may declare the session lost (its session timeout, when shorter).
-- The one rule fleet.heartbeat grants, fleet.lease_held answers, fleet.reconcile repairs by and
-- fleet.stuck_tasks shows; no task row is written to renew a lease.
create or replace function fleet._lease_until(p_heartbeat timestamptz, p_lease_seconds int,
                                              p_session_timeout_seconds int)
returns timestamptz
language sql
immutable
as $$
    select p_heartbeat + make_interval(secs => least(p_lease_seconds,
                                                     coalesce(p_session_timeout_seconds, p_lease_seconds)))
$$;
revoke all on function fleet._lease_until(timestamptz,int,int) from public;
-- (fleet_operator: fleet.stuck_tasks reads as its caller)
grant execute on function fleet._lease_until(timestamptz,int,int) to fleet_operator, service_role;

-- A session of a lane the caller's key may work, locked, or LF006 "unknown session": a session of
-- another lane answers exactly as one that does not exist (and is never locked: the lane is
-- checked before the row lock is taken, so a call cannot even wait on another lane's session).
create or replace function fleet._lock_session(p_session uuid)
returns fleet.sessions
language plpgsql
as $$
declare
    s fleet.sessions;
begin
    select * into s from fleet.sessions where id = p_session and fleet._lane_allowed(lane) for no key update;
    if not found then
        perform fleet._raise('LF006', format('unknown session %s', p_session));
    end if;
    return s;
end
$$;
revoke all on function fleet._lock_session(uuid) from public;
grant execute on function fleet._lock_session(uuid) to service_role;

-- The active session, locked, or LF006 (fleet._lock_session: unknown, or another lane's).
create or replace function fleet._active_session(p_session uuid)
returns fleet.sessions
language plpgsql
as $$
declare
    s fleet.sessions;
begin
    s := fleet._lock_session(p_session);
    if s.state <> 'active' then
        perform fleet._raise('LF006',
            format('session %s is %s (%s); its tasks were released', p_session, s.state,
                   coalesce(s.end_reason, 'no reason given')));
    end if;
    return s;
end
$$;
revoke all on function fleet._active_session(uuid) from public;
grant execute on function fleet._active_session(uuid) to service_role;

-- Lock a running task whose lease p_token holds, or raise: LF003 if there is no such task (or it
-- is a task of a lane the caller's key may not work: the same answer, and no lock taken on it),
-- LF001 ("lease lost") if the token does not hold it. The fence of every worker call.
create or replace function fleet._fenced(p_task bigint, p_token uuid)
returns fleet.tasks
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    t := fleet._lock_task(p_task);
    if t.state <> 'running' or p_token is null or t.lease_token <> p_token then
        perform fleet._raise('LF001',
            format('lease lost: task %s is %s and this lease no longer holds it', p_task, t.state));
    end if;
    return t;
end
$$;
revoke all on function fleet._fenced(bigint,uuid) from public;
grant execute on function fleet._fenced(bigint,uuid) to service_role;

-- Lock a task of a lane the caller's key may work, or raise LF003 "unknown task": a task of another
-- lane answers exactly as one that does not exist. The lane is part of the lookup, so another
-- lane's task is never locked (nor waited on). (What _fenced, cancel, retry, resume and the
-- reviews share.)
create or replace function fleet._lock_task(p_task bigint)
returns fleet.tasks
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    select * into t from fleet.tasks where id = p_task and fleet._lane_allowed(lane) for no key update;
    if not found then
        perform fleet._raise('LF003', format('unknown task %s', p_task));
    end if;
    return t;
end
$$;
revoke all on function fleet._lock_task(bigint) from public;
grant execute on function fleet._lock_task(bigint) to service_role;

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
           -- repaired work first: claimed before fresh work of its priority, as a hand-off is
           carry_over = v_state = 'queued',
           dead_reason = case when v_state = 'dead' then 'attempt-cap' end,
           finished_at = case when v_state = 'dead' then now() end,
           updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(t.lease_token, 'lost', 'released: ' || p_reason);
    perform fleet._event('repaired', t.lane, p_task, t.session_id,
        jsonb_build_object('reason', p_reason, 'state', v_state, 'attempt', t.attempts,
                           'evaporations', t.evaporations + 1,
                           -- when the lease that is repaired ran out (or runs out: a release
                           -- before that): it follows the session's last heartbeat
                           'lease_expired_at', coalesce(
                               (select fleet._lease_until(s.heartbeat_at, l.lease_seconds, l.session_timeout_seconds)
                                  from fleet.sessions s join fleet.lanes l on l.name = s.lane
                                 where s.id = t.session_id),
                               t.lease_expires_at)));
    return v_state;
end
$$;
revoke all on function fleet._release(bigint,text) from public;
grant execute on function fleet._release(bigint,text) to service_role;

-- The attempt cap of a task: its own, or its lane's.
create or replace function fleet._cap(t fleet.tasks)
returns int
language sql
stable
as $$
    select coalesce(t.max_attempts, (select max_attempts from fleet.lanes where name = t.lane));
$$;
revoke all on function fleet._cap(fleet.tasks) from public;
grant execute on function fleet._cap(fleet.tasks) to service_role;

-- UTC hours: date_bin() from a UTC midnight (plain arithmetic, unlike a time-zone conversion)
create or replace function fleet._utc_hour(p_ts timestamptz)
returns timestamptz
language sql
immutable
parallel safe
as $$
    select date_bin('1 hour', p_ts, timestamptz '2000-01-01 00:00:00+00');
$$;
revoke all on function fleet._utc_hour(timestamp with time zone) from public;
-- (fleet_operator: fleet.throughput_hourly and fleet.usage_by_lane_day read as their caller)
grant execute on function fleet._utc_hour(timestamp with time zone) to fleet_operator, service_role;

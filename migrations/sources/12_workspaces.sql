-- The record of task workspaces on each host, and its reaper.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- Fenced by the lease: only the shift that holds the task records its workspace. The first call
-- for a task, host and path makes the row; later ones (the same attempt's end, a retry, the
-- attempt after a hand-off) move last_used_at and the size. A workspace reaped before and made
-- again (a task retried after its retention) is active again, created now. p_bytes NULL keeps
-- the last size. Returns the workspace's id.
create or replace function fleet.touch_workspace(p_task bigint, p_token uuid, p_host text, p_path text,
                                                 p_bytes bigint default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    v_id bigint;
begin
    if p_host is null or p_host = '' then
        perform fleet._raise('LF005', 'a workspace needs its host');
    end if;
    if p_path is null or p_path = '' or length(p_path) > 4096 then
        perform fleet._raise('LF005', 'a workspace needs its path (at most 4096 characters)');
    end if;
    if p_bytes is not null and p_bytes < 0 then
        perform fleet._raise('LF005', format('a workspace''s size must be 0 or more bytes, not %s', p_bytes));
    end if;
    -- lock order: the task (here, through the fence), then its workspace row, as workspace_reaped
    t := fleet._fenced(p_task, p_token);
    insert into fleet.workspaces as w (task_id, lane, host, path, bytes)
    values (p_task, t.lane, p_host, p_path, coalesce(p_bytes, 0))
    on conflict on constraint workspace_task_host_path do update
       set last_used_at = now(),
           lane = excluded.lane,
           bytes = coalesce(p_bytes, w.bytes),
           created_at = case when w.state = 'reaped' then now() else w.created_at end,
           state = 'active', reaped_at = null, bytes_freed = null
    returning w.id into v_id;
    return v_id;
end
$$;
revoke all on function fleet.touch_workspace(bigint,uuid,text,text,bigint) from public;
grant execute on function fleet.touch_workspace(bigint,uuid,text,text,bigint) to fleet_worker, service_role;

-- Where the shift works the task on p_host: the path of its active workspace there in the lane it
-- is in now (the most recently used, if several), or NULL when it has none. A shift resolves the
-- directory from this row rather than by computing a name from the key, so a workspace made under
-- an older naming (`<key made safe>`, before `<slug>-<hash>`) keeps being used by its task.
-- Fenced by the lease, as touch_workspace.
create or replace function fleet.task_workspace(p_task bigint, p_token uuid, p_host text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    v_path text;
begin
    t := fleet._fenced(p_task, p_token);
    select w.path into v_path
      from fleet.workspaces w
     where w.task_id = p_task and w.host = p_host and w.lane = t.lane and w.state = 'active'
     order by w.last_used_at desc, w.id desc
     limit 1;
    return v_path;
end
$$;
revoke all on function fleet.task_workspace(bigint,uuid,text) from public;
grant execute on function fleet.task_workspace(bigint,uuid,text) to fleet_worker, service_role;

-- Whether the active workspace of a task other than p_task on p_host names the directory p_path and keeps it: its
-- task is live, or finished within its lane's retention. Workspace names carry a hash of the whole
-- key, so two tasks never get one directory now; an older naming made some keys alike (`coll a`,
-- `coll_a`), and such a directory is never reaped from under a task that still works in it. One
-- definition for workspaces_to_reap, workspace_reaped and the usage view.
create or replace function fleet._workspace_shared(p_task bigint, p_host text, p_path text)
returns boolean
language sql
stable
as $$
    select exists (
        select 1
          from fleet.workspaces o
          join fleet.tasks ot on ot.id = o.task_id
          left join fleet.lanes ol on ol.name = o.lane
         where o.host = p_host and o.path = p_path and o.state = 'active' and o.task_id <> p_task
           and coalesce(fleet._workspace_expires_at(ot.state, ot.finished_at, o.last_used_at, ol.config)
                        > now(), true));
$$;
revoke all on function fleet._workspace_shared(bigint,text,text) from public;
grant execute on function fleet._workspace_shared(bigint,text,text) to fleet_operator, service_role;

-- The host's active workspaces whose task finished more than the lane's retention ago (and that
-- no attempt used since), oldest first, at most p_limit (100 by default, 1000 at most). Never a
-- directory another task's workspace still keeps (_workspace_shared). Only the lanes the caller's
-- key may work.
create or replace function fleet.workspaces_to_reap(p_host text, p_limit int default 100)
returns table (id bigint, task_id bigint, lane text, host text, path text, bytes bigint,
               last_used_at timestamptz, task_state text, finished_at timestamptz)
language sql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
    select w.id, w.task_id, w.lane, w.host, w.path, w.bytes, w.last_used_at, t.state, t.finished_at
      from fleet.workspaces w
      join fleet.tasks t on t.id = w.task_id
      left join fleet.lanes l on l.name = w.lane
     where w.host = p_host
       and w.state = 'active'
       and fleet._workspace_expires_at(t.state, t.finished_at, w.last_used_at, l.config) <= now()
       and not fleet._workspace_shared(w.task_id, w.host, w.path)
       and fleet._lane_allowed(w.lane)
     order by fleet._workspace_expires_at(t.state, t.finished_at, w.last_used_at, l.config), w.id
     limit least(greatest(coalesce(p_limit, 100), 0), 1000);
$$;
revoke all on function fleet.workspaces_to_reap(text,integer) from public;
grant execute on function fleet.workspaces_to_reap(text,integer) to fleet_operator, service_role;

-- Mark a workspace reaped, if it still may be: under the task's lock, the task must still be
-- finished past the retention (a task retried since workspaces_to_reap keeps its workspace: false),
-- and no other task's workspace that is kept may name the same directory (false).
-- The monitor removes the directory only after this returned true. Safe to repeat: a workspace
-- reaped already answers true as long as its task is still finished past the retention (a call
-- whose answer was lost on the way is made again; a second monitor finds the directory gone).
-- One event per reap.
create or replace function fleet.workspace_reaped(p_id bigint, p_bytes_freed bigint default null)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    w fleet.workspaces;
    t fleet.tasks;
    v_config jsonb;
begin
    if p_bytes_freed is not null and p_bytes_freed < 0 then
        perform fleet._raise('LF005', format('bytes freed must be 0 or more, not %s', p_bytes_freed));
    end if;
    -- a workspace of a lane the caller's key may not work answers as one that does not exist
    select * into w from fleet.workspaces where id = p_id and fleet._lane_allowed(lane);
    if not found then
        perform fleet._raise('LF003', format('unknown workspace %s', p_id));
    end if;
    -- lock order: the task, then its workspace row (as touch_workspace and every transition): a
    -- retry, a claim or a touch of this task waits for this call, or this call sees their outcome
    select * into t from fleet.tasks where id = w.task_id for no key update;
    select * into w from fleet.workspaces where id = p_id for update;
    if not found then
        return false;
    end if;
    select config into v_config from fleet.lanes where name = w.lane;
    if fleet._workspace_expires_at(t.state, t.finished_at, w.last_used_at, v_config) is null
       or fleet._workspace_expires_at(t.state, t.finished_at, w.last_used_at, v_config) > now() then
        return false;
    end if;
    -- the directory is another task's too (two keys that an older naming made alike): it stays
    -- while that task keeps it
    if fleet._workspace_shared(w.task_id, w.host, w.path) then
        return false;
    end if;
    if w.state = 'reaped' then
        return true;
    end if;
    update fleet.workspaces
       set state = 'reaped', reaped_at = now(), bytes_freed = coalesce(p_bytes_freed, w.bytes)
     where id = p_id;
    perform fleet._event('workspace_reaped', w.lane, w.task_id, null,
        jsonb_build_object('workspace', p_id, 'host', w.host, 'path', w.path, 'task_state', t.state,
                           'bytes_freed', coalesce(p_bytes_freed, w.bytes),
                           'created_at', w.created_at, 'last_used_at', w.last_used_at));
    return true;
end
$$;
revoke all on function fleet.workspace_reaped(bigint,bigint) from public;
grant execute on function fleet.workspace_reaped(bigint,bigint) to fleet_operator, service_role;

-- When a workspace becomes reapable: the lane's retention after its task finished and after it
-- was last used; NULL while the task is live (any state but done, dead and cancelled). One
-- definition for workspaces_to_reap, workspace_reaped and the usage view.
create or replace function fleet._workspace_expires_at(p_task_state text, p_finished_at timestamptz,
                                                       p_last_used_at timestamptz, p_lane_config jsonb)
returns timestamptz
language sql
immutable
as $$
    select case when p_task_state in ('done', 'dead', 'cancelled') and p_finished_at is not null then
                greatest(p_finished_at, p_last_used_at)
                + make_interval(secs => case when jsonb_typeof(p_lane_config -> 'workspace_retention_seconds') = 'number'
                                             then greatest((p_lane_config ->> 'workspace_retention_seconds')::double precision, 0)
                                             else 7 * 86400 end)
           end;
$$;
revoke all on function fleet._workspace_expires_at(text,timestamp with time zone,timestamp with time zone,jsonb) from public;
grant execute on function fleet._workspace_expires_at(text,timestamp with time zone,timestamp with time zone,jsonb) to fleet_operator, service_role;

-- Security invoker: it reads the tables as its caller, through their row policies (a key sees the
-- workspaces of its lanes).
create or replace view fleet.workspace_usage with (security_invoker = true) as
select w.lane,
       w.host,
       count(*) as workspaces,
       coalesce(sum(w.bytes), 0)::bigint as bytes,
       count(*) filter (where x.expires_at is null) as live,
       min(w.last_used_at) as oldest_last_used_at,
       count(*) filter (where x.expires_at <= now() and not x.shared) as reapable,
       coalesce(sum(w.bytes) filter (where x.expires_at <= now() and not x.shared), 0)::bigint as reapable_bytes,
       min(x.expires_at) as next_reap_at
  from fleet.workspaces w
  join fleet.tasks t on t.id = w.task_id
  left join fleet.lanes l on l.name = w.lane
  cross join lateral (select fleet._workspace_expires_at(t.state, t.finished_at, w.last_used_at, l.config)
                             as expires_at,
                             fleet._workspace_shared(w.task_id, w.host, w.path) as shared) x
 where w.state = 'active'
 group by w.lane, w.host;
comment on view fleet.workspace_usage is
    'Disk use of task workspaces per lane and host (active ones: on disk, not reaped yet).';
comment on column fleet.workspace_usage.lane is 'the lane whose directories these are';
comment on column fleet.workspace_usage.host is 'the host they are on';
comment on column fleet.workspace_usage.workspaces is 'active workspaces';
comment on column fleet.workspace_usage.bytes is 'their disk use as last measured (at the end of each attempt)';
comment on column fleet.workspace_usage.live is 'of those, workspaces of live tasks (never reaped)';
comment on column fleet.workspace_usage.oldest_last_used_at is 'the longest-unused workspace''s last use';
comment on column fleet.workspace_usage.reapable is 'workspaces past their lane''s retention: the next monitor pass on the host reaps them';
comment on column fleet.workspace_usage.reapable_bytes is 'their disk use';
comment on column fleet.workspace_usage.next_reap_at is 'when the next (or an overdue) workspace becomes reapable';
revoke all on fleet.workspace_usage from service_role;
grant select on fleet.workspace_usage to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.workspace_usage
    for each row execute function fleet._read_only_view();

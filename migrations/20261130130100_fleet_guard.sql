-- lanefleet: fenced side effects (`fleet guard -- CMD`, issue #9 item 5).
--
-- An agent never has database credentials; it asks its shift (worker/guard.py, over a Unix
-- socket), and the shift asks the database with this function at that moment. Read only: it
-- takes no lock and changes nothing, so the answer is a check, not a lock — the shift still kills
-- the agent's process group when a heartbeat finds the lease gone.

-- Does p_token still hold task p_task? True only if the task is running under exactly that token
-- and its lease has not expired by the database's clock (a lease the monitor has not repaired yet
-- but that ran out is not held: someone may repair it any moment). `state` is the task's state,
-- 'unknown' when there is no such task. LF008 if the caller may not work the task's lane.
create or replace function fleet.lease_held(p_task bigint, p_token uuid)
returns table (held boolean, state text)
language plpgsql
stable
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

------------------------------------------------------------------------------------------------
-- security: as in 20261130100400_fleet_roles_rls.sql — run as the owner, search_path pinned,
-- closed to PUBLIC, granted to the workers (a shift answers its agents) and service_role

alter function fleet.lease_held(bigint, uuid) security definer set search_path = pg_catalog, fleet, pg_temp;

revoke execute on function fleet.lease_held(bigint, uuid) from public;
grant execute on function fleet.lease_held(bigint, uuid) to service_role;
grant execute on function fleet.lease_held(bigint, uuid) to fleet_worker;

-- PostgREST, if it runs, reloads its schema cache
notify pgrst, 'reload schema';

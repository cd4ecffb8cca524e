-- A task's lane, checked once per statement (#24).
--
-- A foreign key checks each row it writes with a query of its own (an RI trigger per row, run
-- through SPI): an enqueue_many of 1,000 tasks made a thousand of them for the lanes. The
-- triggers below hold the rule of the foreign key tasks.lane -> lanes.name (on update cascade)
-- that they replace, and take its lock (FOR KEY SHARE of each lane named, so that a delete of it
-- waits for the writer to commit), but look at a statement's rows together (its transition
-- table): two queries per statement. The other side, a delete or a rename of a lane, is a trigger
-- too. Nothing in lanefleet deletes or renames a lane (it retires one); those triggers answer what
-- a person's SQL does, as the key did.
--
--   lane_known          new tasks: each one's lane is a row of fleet.lanes
--   lane_changed        a task that changed lanes (a route, a rename): its new lane
--   tasks_keep_lane     a lane with tasks is not deleted
--   tasks_follow_rename a renamed lane's tasks follow it
--
-- The same change for the runs' task and session (runs.task_id, runs.session_id) measured no
-- faster: a claim writes 1 to 100 runs, and a trigger's fixed cost per statement ate what the
-- per-row checks cost (bench/README.md, "#24, continued: a task's lane checked per statement").

-- new tasks (a statement's, new_rows): each one's lane. The lanes named are locked and counted in
-- one query; only a statement that names a missing one looks for it.
create or replace function fleet._tasks_lanes_known()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_named bigint;
    v_there bigint;
    v_lane text;
begin
    select count(distinct n.lane) into v_named from new_rows n;
    perform 1 from fleet.lanes l where l.name in (select n.lane from new_rows n) for key share of l;
    get diagnostics v_there = row_count;
    if v_there < v_named then
        select n.lane into v_lane
          from new_rows n
         where not exists (select 1 from fleet.lanes l where l.name = n.lane)
         limit 1;
        raise exception using errcode = 'foreign_key_violation',
            message = format('fleet.tasks: lane %L names no row of fleet.lanes', v_lane),
            schema = 'fleet', table = 'tasks', column = 'lane';
    end if;
    return null;
end
$$;
revoke all on function fleet._tasks_lanes_known() from public;
grant execute on function fleet._tasks_lanes_known() to service_role;
create or replace trigger lane_known after insert on fleet.tasks
    referencing new table as new_rows for each statement execute function fleet._tasks_lanes_known();

-- a task that changed lanes (a route, a lane's rename): its new lane
create or replace function fleet._task_lane_known()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    perform 1 from fleet.lanes l where l.name = new.lane for key share of l;
    if not found then
        raise exception using errcode = 'foreign_key_violation',
            message = format('fleet.tasks: lane %L names no row of fleet.lanes', new.lane),
            schema = 'fleet', table = 'tasks', column = 'lane';
    end if;
    return null;
end
$$;
revoke all on function fleet._task_lane_known() from public;
grant execute on function fleet._task_lane_known() to service_role;
create or replace trigger lane_changed after update of lane on fleet.tasks
    for each row when (old.lane is distinct from new.lane) execute function fleet._task_lane_known();

-- a lane with tasks is never deleted (retire it: fleet.retire_lane); a renamed lane's tasks follow
create or replace function fleet._lane_deleted()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    -- (tasks_lane_state; the row is locked by now, so an enqueue in flight has committed)
    if exists (select 1 from fleet.tasks t where t.lane = old.name) then
        raise exception using errcode = 'foreign_key_violation',
            message = format('fleet.lanes: lane %L has tasks, so it is not deleted', old.name),
            hint = format('retire it instead: `fleet lanes retire %s`', old.name),
            schema = 'fleet', table = 'lanes', column = 'name';
    end if;
    return old;
end
$$;
revoke all on function fleet._lane_deleted() from public;
grant execute on function fleet._lane_deleted() to service_role;
create or replace trigger tasks_keep_lane before delete on fleet.lanes
    for each row execute function fleet._lane_deleted();

create or replace function fleet._lane_renamed()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    update fleet.tasks t set lane = new.name where t.lane = old.name;
    return null;
end
$$;
revoke all on function fleet._lane_renamed() from public;
grant execute on function fleet._lane_renamed() to service_role;
create or replace trigger tasks_follow_rename after update of name on fleet.lanes
    for each row when (old.name is distinct from new.name) execute function fleet._lane_renamed();

-- A task's lane and profile, checked once per statement (#24).
--
-- A foreign key checks each row it writes with a query of its own (an RI trigger per row, run
-- through SPI): an enqueue_many of 1,000 tasks made a thousand of them for the lanes, and queued
-- and ran a thousand more for the profiles, most of them NULL. The triggers below hold the rules
-- of the foreign keys they replace, tasks.lane -> lanes.name and tasks.profile -> profiles.name
-- (both on update cascade), and take their lock (FOR KEY SHARE of each lane and profile named, so
-- that a delete of one waits for the writer to commit), but look at a statement's rows together
-- (its transition table): one query counts what they name, one locks the lanes, one the profiles
-- (only when a task names one). The other side, a delete or a rename of a lane or a profile, is a
-- trigger too. Nothing in lanefleet deletes or renames either (it retires a lane, and keeps every
-- profile fleet.toml ever named); those triggers answer what a person's SQL does, as the keys did.
--
--   references_known       new tasks: each one's lane is a row of fleet.lanes, its profile
--                          (if any) one of fleet.profiles
--   references_changed     a task whose lane or profile changed (a route, a rename): its new ones
--   tasks_keep_lane        a lane with tasks is not deleted
--   tasks_follow_rename    a renamed lane's tasks follow it
--   tasks_keep_profile     a profile tasks name is not deleted
--   tasks_follow_profile   a renamed profile's tasks follow it
--
-- The same change for the runs' task and session (runs.task_id, runs.session_id) measured no
-- faster: a claim writes 1 to 100 runs, and a trigger's fixed cost per statement ate what the
-- per-row checks cost (bench/README.md, "#24, continued: a task's lane checked per statement").

-- new tasks (a statement's, new_rows): each one's lane and profile. What they name is counted in
-- one pass and locked in one query per table; only a statement that names a missing one looks
-- for it.
create or replace function fleet._tasks_references_known()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_lanes bigint;
    v_profiles bigint;
    v_there bigint;
    v_name text;
begin
    select count(distinct n.lane), count(distinct n.profile) into v_lanes, v_profiles from new_rows n;
    perform 1 from fleet.lanes l where l.name in (select n.lane from new_rows n) for key share of l;
    get diagnostics v_there = row_count;
    if v_there < v_lanes then
        select n.lane into v_name
          from new_rows n
         where not exists (select 1 from fleet.lanes l where l.name = n.lane)
         limit 1;
        raise exception using errcode = 'foreign_key_violation',
            message = format('fleet.tasks: lane %L names no row of fleet.lanes', v_name),
            schema = 'fleet', table = 'tasks', column = 'lane';
    end if;
    if v_profiles > 0 then
        perform 1 from fleet.profiles p where p.name in (select n.profile from new_rows n) for key share of p;
        get diagnostics v_there = row_count;
        if v_there < v_profiles then
            select n.profile into v_name
              from new_rows n
             where n.profile is not null
               and not exists (select 1 from fleet.profiles p where p.name = n.profile)
             limit 1;
            raise exception using errcode = 'foreign_key_violation',
                message = format('fleet.tasks: profile %L names no row of fleet.profiles', v_name),
                schema = 'fleet', table = 'tasks', column = 'profile';
        end if;
    end if;
    return null;
end
$$;
revoke all on function fleet._tasks_references_known() from public;
grant execute on function fleet._tasks_references_known() to service_role;
create or replace trigger references_known after insert on fleet.tasks
    referencing new table as new_rows for each statement execute function fleet._tasks_references_known();

-- a task whose lane or profile changed (a route, a rename): its new ones
create or replace function fleet._task_references_known()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    if new.lane is distinct from old.lane then
        perform 1 from fleet.lanes l where l.name = new.lane for key share of l;
        if not found then
            raise exception using errcode = 'foreign_key_violation',
                message = format('fleet.tasks: lane %L names no row of fleet.lanes', new.lane),
                schema = 'fleet', table = 'tasks', column = 'lane';
        end if;
    end if;
    if new.profile is distinct from old.profile and new.profile is not null then
        perform 1 from fleet.profiles p where p.name = new.profile for key share of p;
        if not found then
            raise exception using errcode = 'foreign_key_violation',
                message = format('fleet.tasks: profile %L names no row of fleet.profiles', new.profile),
                schema = 'fleet', table = 'tasks', column = 'profile';
        end if;
    end if;
    return null;
end
$$;
revoke all on function fleet._task_references_known() from public;
grant execute on function fleet._task_references_known() to service_role;
create or replace trigger references_changed after update of lane, profile on fleet.tasks
    for each row when (old.lane is distinct from new.lane
                       or (old.profile is distinct from new.profile and new.profile is not null))
    execute function fleet._task_references_known();

-- the other side, for both: a lane or a profile that tasks name is never deleted (retire a lane:
-- fleet.retire_lane), and a renamed one's tasks follow it. TG_ARGV[0]: the column of fleet.tasks
-- that names the row; TG_ARGV[1]: the hint of the refusal, %s the row's name.
create or replace function fleet._named_by_tasks_deleted()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_named boolean;
begin
    -- (the row is locked by now, so an enqueue in flight has committed; no index holds every
    -- task by lane or by profile, so this may scan fleet.tasks: nothing in lanefleet deletes either)
    execute format('select exists (select 1 from fleet.tasks t where t.%I = $1)', tg_argv[0])
       into v_named using old.name;
    if v_named then
        raise exception using errcode = 'foreign_key_violation',
            message = format('fleet.%s: %s %L has tasks, so it is not deleted', tg_table_name, tg_argv[0], old.name),
            hint = format(tg_argv[1], old.name),
            schema = 'fleet', table = tg_table_name, column = 'name';
    end if;
    return old;
end
$$;
revoke all on function fleet._named_by_tasks_deleted() from public;
grant execute on function fleet._named_by_tasks_deleted() to service_role;

create or replace function fleet._named_by_tasks_renamed()
returns trigger
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    execute format('update fleet.tasks t set %1$I = $1 where t.%1$I = $2', tg_argv[0]) using new.name, old.name;
    return null;
end
$$;
revoke all on function fleet._named_by_tasks_renamed() from public;
grant execute on function fleet._named_by_tasks_renamed() to service_role;

create or replace trigger tasks_keep_lane before delete on fleet.lanes
    for each row execute function fleet._named_by_tasks_deleted('lane', 'retire it instead: `fleet lanes retire %s`');
create or replace trigger tasks_follow_rename after update of name on fleet.lanes
    for each row when (old.name is distinct from new.name) execute function fleet._named_by_tasks_renamed('lane');
create or replace trigger tasks_keep_profile before delete on fleet.profiles
    for each row execute function fleet._named_by_tasks_deleted('profile', 'a task keeps the profile it was given, a finished one too');
create or replace trigger tasks_follow_profile after update of name on fleet.profiles
    for each row when (old.name is distinct from new.name) execute function fleet._named_by_tasks_renamed('profile');

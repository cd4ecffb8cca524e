-- lanefleet: roles, grants and row level security (DESIGN §8), for Supabase's REST API.
--
-- Who may do what:
--   anon, authenticated  nothing in schema fleet (not even USAGE on it)
--   fleet_worker         the worker functions; reads the rows of its lanes (RLS)
--   fleet_operator       enqueue, cancel, retry, the monitor's repairs; reads every table and view
--   service_role         everything (BYPASSRLS on Supabase)
-- A key is a JWT whose `role` claim names one of these roles and whose `fleet_lanes` claim lists
-- the lanes it may work (fleet._allowed_lanes). The API functions run as their owner (SECURITY
-- DEFINER, search_path pinned) and check the lane themselves before they write (LF008); RLS
-- limits what the roles read directly.
--
-- The same file applies to a Supabase project (where anon, authenticated, service_role and
-- authenticator exist already) and to a plain PostgreSQL (tests, `fleet dev-stack`): roles are
-- created only where missing. Roles are cluster-wide; two databases of one cluster may run this at
-- the same moment, so every role change tolerates the other having just made it.

------------------------------------------------------------------------------------------------
-- 1. roles

do $$
declare
    r record;
begin
    -- in this order everywhere: two concurrent migrators then wait for each other, never deadlock
    for r in select * from (values
            (1, 'anon', 'nologin noinherit'),
            (2, 'authenticated', 'nologin noinherit'),
            (3, 'service_role', 'nologin noinherit'),
            -- the role PostgREST logs in as; a stack that runs PostgREST gives it LOGIN and a password
            (4, 'authenticator', 'nologin noinherit'),
            (5, 'fleet_worker', 'nologin noinherit'),
            (6, 'fleet_operator', 'nologin noinherit')) as v(n, name, attrs)
        order by n
    loop
        if not exists (select 1 from pg_catalog.pg_roles where rolname = r.name) then
            begin
                execute format('create role %I %s', r.name, r.attrs);
                if r.name = 'service_role'
                   and (select rolsuper from pg_catalog.pg_roles where rolname = current_user) then
                    execute 'alter role service_role bypassrls';  -- as on Supabase
                end if;
            exception when duplicate_object or unique_violation then
                null;  -- another database of this cluster created it just now
            end;
        end if;
    end loop;

    -- PostgREST switches from authenticator to the role a key names
    for r in select * from (values (1, 'anon'), (2, 'authenticated'), (3, 'service_role'),
                                   (4, 'fleet_worker'), (5, 'fleet_operator')) as v(n, name)
        order by n
    loop
        if not pg_catalog.pg_has_role('authenticator', r.name, 'MEMBER') then
            begin
                execute format('grant %I to authenticator', r.name);
            exception when duplicate_object or unique_violation then
                null;
            end;
        end if;
    end loop;
end
$$;

------------------------------------------------------------------------------------------------
-- 2. small API additions for the REST back-end (what the psycopg store does in SQL text)

-- enqueue with run_at = the database's now() + a delay (`fleet enqueue --run-at +10m`)
create or replace function fleet.enqueue_after(
    p_delay_seconds double precision, p_lane text, p_key text, p_payload jsonb default '{}',
    p_priority int default 0, p_max_attempts int default null, p_title text default null)
returns table (task_id bigint, created boolean)
language sql
as $$
    select e.task_id, e.created
      from fleet.enqueue_task(p_lane, p_key, p_payload, p_priority,
                              now() + make_interval(secs => coalesce(p_delay_seconds, 0)),
                              p_max_attempts, p_title) e;
$$;

-- The applied migration versions, so a REST-only host can refuse a database that lacks some.
create or replace function fleet.schema_versions()
returns text[]
language plpgsql
stable
as $$
begin
    if to_regclass('supabase_migrations.schema_migrations') is null then
        return '{}';
    end if;
    return coalesce((select array_agg(version::text order by version)
                       from supabase_migrations.schema_migrations), '{}');
end
$$;

-- Ready tasks per lane (the named query ready_by_lane), for `fleet up` over REST. Invoker: RLS.
create or replace function fleet.ready_by_lane()
returns table (lane text, ready bigint)
language sql
stable
as $$
    select t.lane, count(*) from fleet.tasks t
     where t.state = 'queued' and t.run_at <= now()
     group by t.lane;
$$;

-- Per lane: tasks by state, retries, hand-offs, tokens and cost (the named query lane_summary).
-- Invoker: a caller sees the lanes RLS lets it read.
create or replace function fleet.lane_summary()
returns table (lane text, queued bigint, running bigint, done bigint, dead bigint, cancelled bigint,
               retries bigint, handoffs bigint, tokens numeric, cost_usd numeric)
language sql
stable
as $$
    select l.name,
           count(t.id) filter (where t.state = 'queued'),
           count(t.id) filter (where t.state = 'running'),
           count(t.id) filter (where t.state = 'done'),
           count(t.id) filter (where t.state = 'dead'),
           count(t.id) filter (where t.state = 'cancelled'),
           coalesce(sum(t.failures + t.evaporations), 0),
           coalesce(sum(t.handoffs), 0),
           coalesce((select sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens)
                       from fleet.runs r where r.lane = l.name), 0),
           coalesce((select sum(r.cost_usd) from fleet.runs r where r.lane = l.name), 0)
      from fleet.lanes l
      left join fleet.tasks t on t.lane = l.name
     group by l.name
     order by l.name;
$$;

------------------------------------------------------------------------------------------------
-- 3. the API functions run as their owner, with a pinned search_path (pg_temp last: a caller's
--    temporary table can never stand in for a fleet table)

do $$
declare
    f regprocedure;
begin
    for f in
        select p.oid::regprocedure
          from pg_catalog.pg_proc p
          join pg_catalog.pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet'
           and p.proname in ('enqueue_task', 'enqueue', 'enqueue_after', 'open_session', 'claim',
                             'heartbeat', 'checkpoint', 'complete', 'fail', 'hand_off', 'route',
                             'record_run', 'close_session', 'cancel', 'retry', 'sync_lane',
                             'reconcile', 'declare_session_lost', 'schema_versions')
         order by p.oid
    loop
        execute format('alter function %s security definer set search_path = pg_catalog, fleet, pg_temp', f);
    end loop;
end
$$;

------------------------------------------------------------------------------------------------
-- 4. privileges. USAGE on the schema is the outer gate: anon and authenticated never get it.

revoke all on schema fleet from public;
grant usage on schema fleet to fleet_worker, fleet_operator, service_role;

revoke all on all tables in schema fleet from public;
grant select on all tables in schema fleet to fleet_operator;  -- the tables and the views
grant select on fleet.lanes, fleet.sessions, fleet.tasks, fleet.runs, fleet.lane_handoffs, fleet.events
    to fleet_worker;  -- never the views: a view reads as its owner, past RLS
grant all on all tables in schema fleet to service_role;
grant all on all sequences in schema fleet to service_role;

-- Functions: no one but the owner and service_role, then each role its own. (PostgreSQL lets a
-- schema's default privileges only add, so a later migration's new function is EXECUTE-able by
-- PUBLIC until it revokes that; without USAGE on the schema, anon can call it all the same.)
revoke execute on all functions in schema fleet from public;
grant execute on all functions in schema fleet to service_role;

grant execute on function
    fleet.enqueue_task, fleet.enqueue, fleet.enqueue_after, fleet.open_session, fleet.claim,
    fleet.heartbeat, fleet.checkpoint, fleet.complete, fleet.fail, fleet.hand_off, fleet.route,
    fleet.record_run, fleet.close_session, fleet.declare_session_lost, fleet.schema_versions,
    fleet._allowed_lanes, fleet._lane_allowed
    to fleet_worker;
grant execute on function
    fleet.enqueue_task, fleet.enqueue, fleet.enqueue_after, fleet.cancel, fleet.retry,
    fleet.reconcile, fleet.declare_session_lost, fleet.schema_versions, fleet.ready_by_lane,
    fleet.lane_summary, fleet._allowed_lanes, fleet._lane_allowed
    to fleet_operator;

-- the dashboards' roll-up, which the monitor pass and the dashboard commands call
do $$
begin
    if to_regprocedure('fleet.roll_up_lane_hours(int)') is not null then
        grant execute on function fleet.roll_up_lane_hours(int) to fleet_operator;
    end if;
end
$$;

-- and every other read function of the API (STABLE, not a _helper: e.g. the dashboards' ones)
do $$
declare
    f regprocedure;
begin
    for f in
        select p.oid::regprocedure
          from pg_catalog.pg_proc p
          join pg_catalog.pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet' and p.provolatile in ('s', 'i') and p.proname !~ '^_'
         order by p.oid
    loop
        execute format('grant execute on function %s to fleet_operator', f);
    end loop;
end
$$;

-- tables and views of later migrations (e.g. the dashboards)
alter default privileges in schema fleet grant select on tables to fleet_operator;
alter default privileges in schema fleet grant all on tables to service_role;
alter default privileges in schema fleet grant all on sequences to service_role;
alter default privileges in schema fleet grant execute on functions to service_role;

------------------------------------------------------------------------------------------------
-- 5. row level security on every table of the schema. The functions run as the tables' owner (not
--    subject to it); a key reading tables through the API sees the rows of its lanes (a table
--    without a lane column: operators only). (select ...) makes the lane list one InitPlan per
--    query instead of a call per row. service_role is BYPASSRLS on Supabase; where this file had
--    to create it without (a migrator that is not a superuser), its policy keeps it whole.

do $$
declare
    t record;
begin
    for t in
        select c.oid::regclass as rel, c.relname,
               case when c.relname = 'lanes' then 'name'
                    when exists (select 1 from pg_catalog.pg_attribute a
                                  where a.attrelid = c.oid and a.attname = 'lane' and not a.attisdropped)
                    then 'lane' end as lane_column
          from pg_catalog.pg_class c
          join pg_catalog.pg_namespace n on n.oid = c.relnamespace
         where n.nspname = 'fleet' and c.relkind in ('r', 'p')
         order by c.relname
    loop
        execute format('alter table %s enable row level security', t.rel);
        execute format('create policy %I on %s to service_role using (true) with check (true)',
                       t.relname || '_service', t.rel);
        if t.lane_column is not null then
            execute format('create policy %I on %s for select to fleet_worker, fleet_operator using ('
                           '(select fleet._allowed_lanes()) is null'
                           ' or %I = any ((select fleet._allowed_lanes())::text[]))',
                           t.relname || '_of_the_key', t.rel, t.lane_column);
        else
            execute format('create policy %I on %s for select to fleet_operator using (true)',
                           t.relname || '_operators', t.rel);
        end if;
    end loop;
end
$$;

-- PostgREST, if it runs, reloads its schema cache
notify pgrst, 'reload schema';

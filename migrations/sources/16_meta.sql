-- What a host checks before it works: the migrations applied.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- The applied migration versions, so a REST-only host can refuse a database that lacks some.
create or replace function fleet.schema_versions()
returns text[]
language plpgsql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    if to_regclass('supabase_migrations.schema_migrations') is null then
        return '{}';
    end if;
    return coalesce((select array_agg(version::text order by version)
                       from supabase_migrations.schema_migrations), '{}');
end
$$;
revoke all on function fleet.schema_versions() from public;
grant execute on function fleet.schema_versions() to fleet_operator, fleet_worker, service_role;

create or replace function fleet.schema_migration_names()
returns text[]
language plpgsql
stable
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    if to_regclass('supabase_migrations.schema_migrations') is null then
        return '{}';
    end if;
    return coalesce((select array_agg(m.version::text || '_' || m.name order by m.version)
                       from supabase_migrations.schema_migrations m
                      where m.name like 'fleet\_%'), '{}');
end
$$;
comment on function fleet.schema_migration_names() is
    'lanefleet''s applied migrations (names fleet_*) as <version>_<name>, in version order: what a '
    'host compares with its own files to notice a database migrated by a newer lanefleet.';
revoke all on function fleet.schema_migration_names() from public;
grant execute on function fleet.schema_migration_names() to fleet_operator, fleet_worker, service_role;

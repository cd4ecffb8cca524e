-- lanefleet: the names of lanefleet's applied migrations, for the REST store's schema check.
--
-- A host whose lanefleet is older than the database's schema must stop, not call functions whose
-- signatures may have changed. Over a direct connection the check reads
-- supabase_migrations.schema_migrations; over Supabase's API it cannot, and fleet.schema_versions
-- gives versions only (a project's own migrations share the table). This gives the lanefleet ones
-- (names starting fleet_) as '<version>_<name>', so the code can list those it lacks.

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

revoke execute on function fleet.schema_migration_names() from public;
grant execute on function fleet.schema_migration_names() to service_role, fleet_worker, fleet_operator;

notify pgrst, 'reload schema';

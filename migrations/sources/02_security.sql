-- Which lanes the caller's key may work (LF008), for the API functions and the row policies.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet._allowed_lanes()
returns text[]
language plpgsql
stable
as $$
declare
    v_role text := coalesce(nullif(nullif(current_setting('role', true), ''), 'none'), session_user);
    v_owner oid;
    v_lanes jsonb;
begin
    -- Every lane: service_role, members of the owner of schema fleet (which every superuser is, for
    -- pg_has_role), superusers and BYPASSRLS roles. Tested in that order, cheapest first: the usual
    -- direct caller, the migrator, costs one read of pg_namespace and no pg_roles lookup.
    if v_role = 'service_role' then
        return null;
    end if;
    select n.nspowner into v_owner from pg_catalog.pg_namespace n where n.nspname = 'fleet';
    if pg_catalog.pg_has_role(v_role, v_owner, 'MEMBER') then
        return null;
    end if;
    if exists (select 1 from pg_catalog.pg_roles r
                where r.rolname = v_role and (r.rolsuper or r.rolbypassrls)) then
        return null;
    end if;
    -- nullif: a pooled connection that once saw a request keeps the setting, as ''
    v_lanes := nullif(current_setting('request.jwt.claims', true), '')::jsonb -> 'fleet_lanes';
    if v_lanes is null then
        return case when v_role = 'fleet_operator' then null else '{}'::text[] end;
    end if;
    if jsonb_typeof(v_lanes) = 'string' then
        v_lanes := jsonb_build_array(v_lanes);
    end if;
    if jsonb_typeof(v_lanes) <> 'array' then
        return '{}'::text[];
    end if;
    if v_lanes ? '*' then
        return null;
    end if;
    return array(select jsonb_array_elements_text(v_lanes));
end
$$;
revoke all on function fleet._allowed_lanes() from public;
grant execute on function fleet._allowed_lanes() to fleet_operator, fleet_worker, service_role;

-- May the caller work lane p_lane? (NULL: every lane, for fleet-wide calls such as reconcile.)
create or replace function fleet._lane_allowed(p_lane text)
returns boolean
language plpgsql
stable
as $$
declare
    v_lanes text[] := fleet._allowed_lanes();
begin
    return v_lanes is null or (p_lane is not null and p_lane = any (v_lanes));
end
$$;
revoke all on function fleet._lane_allowed(text) from public;
grant execute on function fleet._lane_allowed(text) to fleet_operator, fleet_worker, service_role;

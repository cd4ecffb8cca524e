-- Which lanes the caller's key may work (LF008), for the API functions and the row policies.
--
-- What a key sees. One rule, in one place: the row policies of the tables (`<table>_of_the_key`,
-- made by the migrations: a row of a lane the key may work, fleet._allowed_lanes; pools and
-- profiles: those its lanes draw from). Everything a key reads goes through them:
--   * the tables, read through the API;
--   * every view: security_invoker, so it reads the tables as its caller, through the policies
--     (a row joined in from another lane is not there for it either);
--   * the read functions: SECURITY INVOKER likewise; those that must run as their owner (SECURITY
--     DEFINER) filter each row with fleet._lane_allowed(lane) themselves, and so do the rows whose
--     lane is not the lane of a row read (an hour of a lane a task was routed to).
-- What a key may not see answers as what does not exist: a task, session or workspace of another
-- lane is "unknown" (LF003, LF006), never LF008 naming its lane (fleet._lock_task, fleet._fenced,
-- fleet._lock_session). LF008 names only a lane the caller gave itself. No key writes a view:
-- each is SELECT-only, and fleet._read_only_view makes PostgreSQL check that privilege before it
-- would refuse a view it cannot update (55000, an HTTP 500 through PostgREST; 42501 is a 401/403).
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- (Service_role and superusers are told by their settings, role and is_superuser, which
-- PostgreSQL sets at login, SET ROLE and SET SESSION AUTHORIZATION: a superuser demoted while its
-- session is open keeps every lane in that session until one of those.)
create or replace function fleet._allowed_lanes()
returns text[]
language plpgsql
stable
as $$
declare
    v_role text := coalesce(nullif(nullif(current_setting('role', true), ''), 'none'), session_user);
    v_lanes jsonb;
begin
    -- Every lane: service_role, superusers, members of the owner of schema fleet and BYPASSRLS
    -- roles. The first two by settings, with no catalog read: is_superuser is the superuser flag of
    -- the role set (else of the session's user), what v_role names (a read of pg_namespace and
    -- pg_roles costs each transaction ~20 µs, and a completion makes this test once or more; a
    -- superuser is the direct caller of an embedded or local server); the other two in one read.
    if v_role = 'service_role' or current_setting('is_superuser') = 'on' then
        return null;
    end if;
    if exists (select 1 from pg_catalog.pg_roles r, pg_catalog.pg_namespace n
                where r.rolname = v_role and n.nspname = 'fleet'
                  and (r.rolsuper or r.rolbypassrls or pg_catalog.pg_has_role(r.oid, n.nspowner, 'MEMBER'))) then
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

-- The trigger of every view (INSTEAD OF INSERT, UPDATE, DELETE): the views are read-only. A view
-- PostgreSQL cannot update by itself (a join, an aggregate, WITH) refuses a write before any
-- privilege is checked (55000: "cannot insert into view"), which PostgREST answers with HTTP 500;
-- with this trigger the write reaches the privilege check (42501: PostgREST's 401/403) and, for a
-- role that holds the privilege anyway, this refusal.
create or replace function fleet._read_only_view()
returns trigger
language plpgsql
as $$
begin
    raise exception using errcode = 'insufficient_privilege',
        message = format('%I.%I is a read-only view', tg_table_schema, tg_table_name),
        hint = 'the views are read, never written: change the fleet through the fleet.* functions';
end
$$;
revoke all on function fleet._read_only_view() from public;
grant execute on function fleet._read_only_view() to service_role;

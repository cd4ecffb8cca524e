-- lanefleet: cheaper claims and completions, the same guarantees (issue #7; bench/README.md, "What
-- bounds lanefleet where it loses", points 2 and 3).
--
-- 1. fleet.claim locks the lane row only when the lane has a limit counted across claims
--    (max_running, review_cap, a daily budget). The claims of a lane without one no longer wait
--    for each other's commits. fleet.sync_lane and the claims still exclude each other, through a
--    transaction-scoped advisory key per lane (shared by claims, exclusive for the sync), so a
--    lane's limits never change under a claim in flight.
--    Large claims (more than 32 tasks) take turns through a second per-lane key, exclusive among
--    them: side by side, 16 claimers of 100 scanned past each other's uncommitted rows at the head
--    of tasks_ready (batch mode c16 lost a quarter of its speed). A shift's claims never wait there.
-- 2. The caller's lane check tests the cheap cases first: service_role, then membership of the
--    schema's owner (superusers included), before the pg_roles lookup; same answers as before.
-- 3. The helpers on the hot path that were LANGUAGE sql (_event, _end_run, _lane_allowed,
--    _done_state) are PL/pgSQL: PostgreSQL parses and plans a SQL function called from PL/pgSQL
--    again in every transaction, a PL/pgSQL one once per connection. Same signatures, same
--    behaviour; CREATE OR REPLACE keeps their grants.

------------------------------------------------------------------------------------------------
-- the caller's lanes (see 20261130100100_fleet_api.sql for what a key may work)

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

------------------------------------------------------------------------------------------------
-- the helpers of every transition, as PL/pgSQL

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

-- Close the run row of a lease.
create or replace function fleet._end_run(p_token uuid, p_outcome text, p_error text default null)
returns void
language plpgsql
as $$
begin
    update fleet.runs
       set outcome = p_outcome,
           ended_at = now(),
           error_tail = coalesce(error_tail, left(p_error, 4000))
     where lease_token = p_token and ended_at is null;
end
$$;

-- What a completed task of the lane becomes: review when the lane requires one, else done.
create or replace function fleet._done_state(p_lane text)
returns text
language plpgsql
stable
as $$
begin
    return case when coalesce((select (config ->> 'review')::boolean from fleet.lanes where name = p_lane), false)
                then 'review' else 'done' end;
end
$$;

------------------------------------------------------------------------------------------------
-- claim: the lane lock only where a limit needs it (the rest as in 20261130130000_fleet_guardrails.sql)

create or replace function fleet.claim(p_session uuid, p_limit int default 1)
returns setof fleet.tasks
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    s fleet.sessions;
    l fleet.lanes;
    v_free int;
    v_avail jsonb := '{}';
    v_lane_cands jsonb;
    v_cands jsonb;
    v_choice jsonb;
    v_idx int;
    v_pool text;
    v_t fleet.tasks;
    v_c fleet.tasks;
    p record;
begin
    if p_limit is null or p_limit < 0 then
        perform fleet._raise('LF005', format('claim limit must be 0 or more, not %s', p_limit));
    end if;
    s := fleet._active_session(p_session);
    update fleet.sessions set heartbeat_at = now() where id = s.id;
    -- The lane's settings do not change under a claim: fleet.sync_lane takes this key exclusively
    -- before it writes the lane, so it waits for the claims in flight, and the claims after it
    -- read what it wrote. Claims take it shared: they never wait for each other here.
    perform pg_catalog.pg_advisory_xact_lock_shared(736610438, pg_catalog.hashtext(s.lane));
    -- Large claims of a lane take turns (a second per-lane key, exclusive among them, held until
    -- commit): side by side, each would scan past the others' uncommitted rows at the head of
    -- tasks_ready. Small claims (a shift's free slots) never wait here.
    if p_limit > 32 then
        perform pg_catalog.pg_advisory_xact_lock(736610439, pg_catalog.hashtext(s.lane));
    end if;
    select * into l from fleet.lanes where name = s.lane;
    -- Serialise the claims of a lane with a limit counted across claims (max_running, review_cap,
    -- a daily budget): the counts below must not change under us, or two claimers could each take
    -- the last free slot. NO KEY UPDATE leaves enqueue's FK lock free. A lane without such a limit
    -- takes no lane lock, so its claims run side by side: FOR UPDATE SKIP LOCKED keeps them off
    -- each other's tasks, and pools count their slots under the pools' own locks (below).
    if l.max_running is not null or (l.config ->> 'review_cap') is not null
       or (l.config ->> 'daily_budget_usd') is not null or (l.config ->> 'daily_budget_tokens') is not null then
        select * into l from fleet.lanes where name = s.lane for no key update;
    end if;
    if l.paused or p_limit = 0 or now() >= s.deadline then
        return;
    end if;
    v_free := p_limit;
    if l.max_running is not null then
        v_free := least(p_limit,
            l.max_running - (select count(*) from fleet.tasks where lane = s.lane and state = 'running'));
    end if;
    if v_free <= 0 then
        return;
    end if;
    -- review debt: no claims while the lane's tasks waiting in review reach its review_cap
    if (l.config ->> 'review_cap') is not null
       and (select count(*) from fleet.tasks x where x.lane = s.lane and x.state = 'review')
           >= (l.config ->> 'review_cap')::int then
        return;
    end if;
    -- a lane over its daily budget claims nothing until the next UTC day
    if (l.config ->> 'daily_budget_usd') is not null or (l.config ->> 'daily_budget_tokens') is not null then
        if exists (select 1 from fleet._lane_spend_today(s.lane) sp
                    where sp.cost_usd >= (l.config ->> 'daily_budget_usd')::numeric
                       or sp.tokens >= (l.config ->> 'daily_budget_tokens')::numeric) then
            return;
        end if;
    end if;

    if not exists (select 1 from fleet.pools) then
        return query
        with ready as (
            -- the next ready tasks of the lane, skipping rows another transaction holds
            -- (not a task this session handed off itself: a hand-off is for the next shift)
            select t.id, t.priority, t.resume, t.run_at
              from fleet.tasks t
             where t.lane = s.lane and t.state = 'queued' and t.run_at <= now()
               and not (t.resume and exists (select 1 from fleet.runs r
                                              where r.task_id = t.id and r.session_id = s.id
                                                and r.outcome = 'handed_off'))
             order by t.priority desc, t.resume desc, t.run_at, t.id
             limit v_free
               for update skip locked
        ), claimed as (
            -- lease them to the session
            update fleet.tasks t
               set state = 'running',
                   attempts = t.attempts + 1,
                   lease_token = gen_random_uuid(),
                   lease_expires_at = now() + make_interval(secs => l.lease_seconds),
                   session_id = s.id,
                   resume = false,
                   last_progress_at = now(),
                   tier = fleet._tier_for(l, t.tier),
                   run_profile = coalesce(t.profile, l.config ->> 'profile'),
                   pool = null,
                   updated_at = now()
              from ready
             where t.id = ready.id
            returning t.*
        ), run_rows as (
            -- one run row per dispatch
            insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, tier, profile)
            select c.id, s.id, c.lane, c.attempts, c.lease_token, c.tier, c.run_profile from claimed c
        ), journal as (
            insert into fleet.events (kind, lane, task_id, session_id, detail)
            select 'claimed', c.lane, c.id, s.id,
                   jsonb_strip_nulls(jsonb_build_object('attempt', c.attempts, 'tier', c.tier,
                                                        'profile', c.run_profile))
              from claimed c
        )
        -- in the order they were picked (the claim clears resume, so order by ready's copy of it)
        select c.* from claimed c join ready r on r.id = c.id
         order by r.priority desc, r.resume desc, r.run_at, r.id;
        return;
    end if;

    -- the free slots of every pool, counted under the pools' locks
    for p in select pl.name, pl.slots, pl.throttled_until from fleet.pools pl order by pl.name for no key update
    loop
        v_avail := v_avail || jsonb_build_object(p.name,
            case when p.throttled_until > now() then 0
                 when p.slots is null then 2147483647
                 else greatest(0, p.slots - (select count(*) from fleet.tasks x
                                              where x.state = 'running' and x.pool = p.name)) end);
    end loop;
    v_lane_cands := case when jsonb_typeof(l.config -> 'dispatch') = 'array'
                              and jsonb_array_length(l.config -> 'dispatch') > 0
                         then l.config -> 'dispatch'
                         else jsonb_build_array(jsonb_build_object(
                                  'pool', (select pf.pool from fleet.profiles pf where pf.name = l.config ->> 'profile'),
                                  'profile', l.config ->> 'profile')) end;

    for v_t in
        select * from fleet.tasks x
         where x.lane = s.lane and x.state = 'queued' and x.run_at <= now()
           and not (x.resume and exists (select 1 from fleet.runs r
                                          where r.task_id = x.id and r.session_id = s.id
                                            and r.outcome = 'handed_off'))
         order by x.priority desc, x.resume desc, x.run_at, x.id
         limit v_free * 10 + 50
           for update skip locked
    loop
        exit when v_free <= 0;
        v_cands := case when v_t.profile is not null
                        then jsonb_build_array(jsonb_build_object(
                                 'pool', (select pf.pool from fleet.profiles pf where pf.name = v_t.profile),
                                 'profile', v_t.profile))
                        else v_lane_cands end;
        v_choice := null;
        -- (a FOR loop's variable exists only inside the loop: keep the index in v_idx)
        for i in 0 .. jsonb_array_length(v_cands) - 1 loop
            if v_cands -> i ->> 'pool' is null or coalesce((v_avail ->> (v_cands -> i ->> 'pool'))::int, 0) > 0 then
                v_choice := v_cands -> i;
                v_idx := i;
                exit;
            end if;
        end loop;
        continue when v_choice is null;  -- every pool it may draw from is throttled or full
        v_pool := v_choice ->> 'pool';

        update fleet.tasks x
           set state = 'running',
               attempts = x.attempts + 1,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => l.lease_seconds),
               session_id = s.id,
               resume = false,
               last_progress_at = now(),
               tier = fleet._tier_for(l, x.tier),
               run_profile = v_choice ->> 'profile',
               pool = v_pool,
               updated_at = now()
         where x.id = v_t.id
        returning x.* into v_c;
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, tier, profile, pool)
        values (v_c.id, s.id, v_c.lane, v_c.attempts, v_c.lease_token, v_c.tier, v_c.run_profile, v_c.pool);
        perform fleet._event('claimed', v_c.lane, v_c.id, s.id,
            jsonb_strip_nulls(jsonb_build_object('attempt', v_c.attempts, 'tier', v_c.tier,
                'profile', v_c.run_profile, 'pool', v_c.pool,
                -- drawn from a pool other than the lane's first choice, because that one was
                -- throttled or full
                'spilled', case when v_t.profile is null and v_idx > 0 then true end,
                'preferred_pool', case when v_t.profile is null and v_idx > 0
                                       then v_lane_cands -> 0 ->> 'pool' end)));
        if v_pool is not null then
            v_avail := jsonb_set(v_avail, array[v_pool], to_jsonb((v_avail ->> v_pool)::int - 1));
        end if;
        v_free := v_free - 1;
        return next v_c;
    end loop;
end
$$;

------------------------------------------------------------------------------------------------
-- sync_lane: waits for the lane's claims in flight (the rest as in 20261130100200_fleet_lanes_reconcile.sql)

create or replace function fleet.sync_lane(p_name text, p_settings jsonb)
returns text
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_known text[] := array['max_running', 'lease_seconds', 'max_attempts', 'max_handoffs',
        'session_timeout_seconds', 'backoff_base_seconds', 'backoff_max_seconds', 'accepts_from',
        'paused', 'config'];
    v_unknown text;
    v_old fleet.lanes;
    v_new fleet.lanes;
begin
    perform fleet._require_lane(p_name);
    if p_name is null or p_name !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a lane name', p_name),
            'lowercase letters, digits, - and _, 63 characters at most');
    end if;
    if p_settings is null or jsonb_typeof(p_settings) <> 'object' then
        perform fleet._raise('LF005', 'lane settings must be a JSON object');
    end if;
    select k into v_unknown from jsonb_object_keys(p_settings) k where k <> all (v_known) limit 1;
    if v_unknown is not null then
        perform fleet._raise('LF005', format('unknown lane setting %L', v_unknown),
            'known: ' || array_to_string(v_known, ', '));
    end if;
    -- after the claims of the lane in flight, before any that would read the old settings (see
    -- fleet.claim: a claim holds this key shared until it commits)
    perform pg_catalog.pg_advisory_xact_lock(736610438, pg_catalog.hashtext(p_name));
    select * into v_old from fleet.lanes where name = p_name for no key update;

    insert into fleet.lanes as l (name, max_running, lease_seconds, max_attempts, max_handoffs,
                                  session_timeout_seconds, backoff_base_seconds, backoff_max_seconds,
                                  accepts_from, paused, config)
    values (p_name,
            (p_settings ->> 'max_running')::int,
            coalesce((p_settings ->> 'lease_seconds')::int, 60),
            coalesce((p_settings ->> 'max_attempts')::int, 3),
            coalesce((p_settings ->> 'max_handoffs')::int, 10),
            (p_settings ->> 'session_timeout_seconds')::int,
            coalesce((p_settings ->> 'backoff_base_seconds')::int, 10),
            coalesce((p_settings ->> 'backoff_max_seconds')::int, 3600),
            case when jsonb_typeof(p_settings -> 'accepts_from') = 'array'
                 then array(select jsonb_array_elements_text(p_settings -> 'accepts_from')) end,
            coalesce((p_settings ->> 'paused')::boolean, false),
            coalesce(p_settings -> 'config', '{}'))
    on conflict (name) do update
       set max_running = excluded.max_running, lease_seconds = excluded.lease_seconds,
           max_attempts = excluded.max_attempts, max_handoffs = excluded.max_handoffs,
           session_timeout_seconds = excluded.session_timeout_seconds,
           backoff_base_seconds = excluded.backoff_base_seconds,
           backoff_max_seconds = excluded.backoff_max_seconds,
           accepts_from = excluded.accepts_from, paused = excluded.paused, config = excluded.config,
           updated_at = now()
    returning * into v_new;

    if v_old.name is null then
        perform fleet._event('lane_created', p_name, null, null, p_settings);
        return 'created';
    end if;
    if (v_old.max_running, v_old.lease_seconds, v_old.max_attempts, v_old.max_handoffs,
        v_old.session_timeout_seconds, v_old.backoff_base_seconds, v_old.backoff_max_seconds,
        v_old.accepts_from, v_old.paused, v_old.config)
       is not distinct from
       (v_new.max_running, v_new.lease_seconds, v_new.max_attempts, v_new.max_handoffs,
        v_new.session_timeout_seconds, v_new.backoff_base_seconds, v_new.backoff_max_seconds,
        v_new.accepts_from, v_new.paused, v_new.config) then
        return 'unchanged';
    end if;
    perform fleet._event('lane_updated', p_name, null, null, p_settings);
    return 'updated';
end
$$;

------------------------------------------------------------------------------------------------
-- security: CREATE OR REPLACE kept every function's owner and grants; claim and sync_lane say
-- SECURITY DEFINER and their search_path above, as before. Nothing new is callable by anyone.

notify pgrst, 'reload schema';

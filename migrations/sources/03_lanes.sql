-- Lanes, pools and profiles as fleet.toml describes them (`fleet lanes sync`), and tier lookups.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- Create or update a lane from fleet.toml's settings. Two keys besides the columns' own:
-- `paused_reason` (what the preflight of the sync found wrong, NULL: nothing; left out: the lane's
-- stays as it is), apart from the operator's `paused`; `retired` (the config's explicit word: true
-- retires the lane as fleet.retire_lane does, false brings it back; left out: a retired lane stays
-- retired, its settings updated, and the answer is 'retired').
create or replace function fleet.sync_lane(p_name text, p_settings jsonb)
returns text
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_known text[] := array['max_running', 'lease_seconds', 'max_attempts', 'max_handoffs',
        'session_timeout_seconds', 'backoff_base_seconds', 'backoff_max_seconds', 'accepts_from',
        'paused', 'config', 'paused_reason', 'retired'];
    v_unknown text;
    v_old fleet.lanes;
    v_new fleet.lanes;
    v_reason text;
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
    if jsonb_typeof(p_settings -> 'retired') not in ('boolean', 'null') then
        perform fleet._raise('LF005', format('lane %s: retired must be true, false or null', p_name));
    end if;
    if jsonb_typeof(p_settings -> 'paused_reason') not in ('string', 'null')
       or btrim(p_settings ->> 'paused_reason') = '' then
        perform fleet._raise('LF005', format('lane %s: paused_reason must be a non-empty text or null', p_name));
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

    if p_settings ? 'paused_reason' then
        v_reason := p_settings ->> 'paused_reason';
        if v_reason is distinct from v_new.paused_reason then
            perform fleet._set_paused_reason(p_name, v_reason, 'sync');
        end if;
    end if;
    if (p_settings ->> 'retired')::boolean and v_new.retired_at is null then
        perform fleet.retire_lane(p_name);
    elsif not (p_settings ->> 'retired')::boolean and v_new.retired_at is not null then
        perform fleet.unretire_lane(p_name);
    end if;
    select * into v_new from fleet.lanes where name = p_name;

    if v_old.name is null then
        perform fleet._event('lane_created', p_name, null, null, p_settings);
        return case when v_new.retired_at is not null then 'retired' else 'created' end;
    end if;
    if v_new.retired_at is not null then
        return 'retired';
    end if;
    if (v_old.max_running, v_old.lease_seconds, v_old.max_attempts, v_old.max_handoffs,
        v_old.session_timeout_seconds, v_old.backoff_base_seconds, v_old.backoff_max_seconds,
        v_old.accepts_from, v_old.paused, v_old.config, v_old.paused_reason, v_old.retired_at)
       is not distinct from
       (v_new.max_running, v_new.lease_seconds, v_new.max_attempts, v_new.max_handoffs,
        v_new.session_timeout_seconds, v_new.backoff_base_seconds, v_new.backoff_max_seconds,
        v_new.accepts_from, v_new.paused, v_new.config, v_new.paused_reason, v_new.retired_at) then
        return 'unchanged';
    end if;
    perform fleet._event('lane_updated', p_name, null, null, p_settings);
    return 'updated';
end
$$;
revoke all on function fleet.sync_lane(text,jsonb) from public;
grant execute on function fleet.sync_lane(text,jsonb) to service_role;

-- Set (p_reason) or clear (NULL) the pause lanefleet puts on a lane whose config it found wrong,
-- journaled as lane_paused / lane_unpaused with what said so (p_by: 'sync', 'preflight', 'run').
-- The caller has checked the lane is the caller's; nothing happens when the reason is the same.
create or replace function fleet._set_paused_reason(p_lane text, p_reason text, p_by text,
                                                    p_detail jsonb default '{}')
returns boolean
language plpgsql
as $$
declare
    v_was text;
begin
    select paused_reason into v_was from fleet.lanes where name = p_lane for no key update;
    if v_was is not distinct from p_reason then
        return false;
    end if;
    update fleet.lanes
       set paused_reason = p_reason, paused_at = case when p_reason is not null then now() end,
           updated_at = now()
     where name = p_lane;
    perform fleet._event(case when p_reason is null then 'lane_unpaused' else 'lane_paused' end, p_lane, null, null,
        jsonb_strip_nulls(coalesce(p_detail, '{}') || jsonb_build_object('reason', p_reason, 'was', v_was,
                                                                         'by', p_by, 'caller', fleet._caller())));
    return true;
end
$$;
revoke all on function fleet._set_paused_reason(text,text,text,jsonb) from public;
grant execute on function fleet._set_paused_reason(text,text,text,jsonb) to service_role;

-- A preflight (a shift's start, `fleet run`) found the lane's config wrong on this host: the lane is
-- paused with the reason (nothing is claimed) until a sync of a fixed config clears it. 'paused',
-- or 'unchanged' when it was paused for that reason already. A worker key may pause its own lanes.
create or replace function fleet.pause_lane(p_lane text, p_reason text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    perform fleet._require_lane(p_lane);
    if p_reason is null or btrim(p_reason) = '' then
        perform fleet._raise('LF005', 'a lane is paused with a reason', 'say what is wrong with its config');
    end if;
    perform fleet._lane(p_lane);  -- LF002 unknown, LF009 retired
    return case when fleet._set_paused_reason(p_lane, left(p_reason, 2000), 'preflight') then 'paused'
                else 'unchanged' end;
end
$$;
revoke all on function fleet.pause_lane(text,text) from public;
grant execute on function fleet.pause_lane(text,text) to fleet_worker, fleet_operator, service_role;

-- How long a task of the lane waits after a failed attempt: backoff_base_seconds * 2^(failures
-- before this one), at most backoff_max_seconds. The one rule of fleet.fail and of a batch member's
-- eviction (fleet.batch_member_evicted).
create or replace function fleet._backoff(l fleet.lanes, p_failures_before int)
returns interval
language sql
immutable
as $$
    select make_interval(secs => least(l.backoff_max_seconds::numeric,
                                       l.backoff_base_seconds * power(2::numeric, least(greatest(p_failures_before, 0), 30)))
                                 ::double precision);
$$;
revoke all on function fleet._backoff(fleet.lanes,integer) from public;
grant execute on function fleet._backoff(fleet.lanes,integer) to service_role;

-- Whether a claim may take the lane's tasks: neither paused (by the operator, or by lanefleet with
-- a reason) nor retired.
create or replace function fleet._lane_claimable(l fleet.lanes)
returns boolean
language sql
immutable
as $$
    select not l.paused and l.paused_reason is null and l.retired_at is null;
$$;
revoke all on function fleet._lane_claimable(fleet.lanes) from public;
grant execute on function fleet._lane_claimable(fleet.lanes) to fleet_operator, service_role;

-- Retire a lane (`fleet lanes retire`): it refuses enqueues and routes into it (LF009), is never
-- claimed, and stays retired through `fleet lanes sync` unless fleet.toml says `retired = false`
-- or fleet.unretire_lane brings it back. Refused (LF004, nothing changed) while the lane has live
-- tasks (queued, running, blocked, review, batched: what is not done, dead or cancelled), naming
-- how many of each. Its finished tasks, runs and journal stay. 'retired', or 'unchanged'.
create or replace function fleet.retire_lane(p_lane text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    l fleet.lanes;
    v_live text;
    v_total bigint;
begin
    perform fleet._require_lane(p_lane);
    -- FOR UPDATE: waits for the enqueues in flight (fleet._lane: FOR KEY SHARE) and holds off new ones
    select * into l from fleet.lanes where name = p_lane for update;
    if not found then
        perform fleet._lane(p_lane);  -- LF002, naming the known lanes
    end if;
    if l.retired_at is not null then
        return 'unchanged';
    end if;
    select string_agg(format('%s %s', n, state), ', ' order by min_ord), sum(n)
      into v_live, v_total
      from (select t.state, count(*) as n,
                   min(array_position(array['queued', 'running', 'blocked', 'review', 'batched'], t.state)) as min_ord
              from fleet.tasks t
             where t.lane = p_lane and t.state not in ('done', 'dead', 'cancelled')
             group by t.state) live;
    if v_total > 0 then
        perform fleet._raise('LF004',
            format('lane %s has %s live task%s (%s): it is retired only when none is left', p_lane, v_total,
                   case when v_total = 1 then '' else 's' end, v_live),
            'let them finish, or `fleet cancel` them (`fleet tasks --lane ' || p_lane || '` lists them)');
    end if;
    update fleet.lanes set retired_at = now(), updated_at = now() where name = p_lane;
    perform fleet._event('lane_retired', p_lane, null, null, jsonb_build_object('by', fleet._caller()));
    return 'retired';
end
$$;
revoke all on function fleet.retire_lane(text) from public;
grant execute on function fleet.retire_lane(text) to fleet_operator, service_role;

-- Bring a retired lane back (`fleet lanes unretire`): it takes tasks again. 'unretired', or
-- 'unchanged' for a lane that was not retired.
create or replace function fleet.unretire_lane(p_lane text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    l fleet.lanes;
begin
    perform fleet._require_lane(p_lane);
    select * into l from fleet.lanes where name = p_lane for no key update;
    if not found then
        perform fleet._lane(p_lane);  -- LF002, naming the known lanes
    end if;
    if l.retired_at is null then
        return 'unchanged';
    end if;
    update fleet.lanes set retired_at = null, updated_at = now() where name = p_lane;
    perform fleet._event('lane_unretired', p_lane, null, null,
        jsonb_build_object('retired_at', l.retired_at, 'by', fleet._caller()));
    return 'unretired';
end
$$;
revoke all on function fleet.unretire_lane(text) from public;
grant execute on function fleet.unretire_lane(text) to fleet_operator, service_role;

-- p_windows: the pool's usage windows ({"<name>": {"seconds", "budget_tokens", "budget_usd",
-- "provider_window", "models"}}, fleet.toml [pools.NAME.windows]; NULL: none), p_reserve the share
-- of each window's budget kept for running work (NULL: 0.1).
create or replace function fleet.sync_pool(p_name text, p_slots int, p_windows jsonb default null,
                                           p_reserve numeric default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_old fleet.pools;
    v_windows jsonb := coalesce(p_windows, '{}');
    v_reserve numeric := coalesce(p_reserve, 0.1);
    k text;
    w jsonb;
begin
    if p_name is null or p_name !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a pool name', p_name),
            'lowercase letters, digits, - and _, 63 characters at most');
    end if;
    if p_slots is not null and p_slots < 0 then
        perform fleet._raise('LF005', format('pool %s: slots must be 0 or more, not %s', p_name, p_slots));
    end if;
    if jsonb_typeof(v_windows) <> 'object' then
        perform fleet._raise('LF005', format('pool %s: windows must be a JSON object of windows', p_name));
    end if;
    for k, w in select * from jsonb_each(v_windows) loop
        if jsonb_typeof(w -> 'seconds') <> 'number' or (w ->> 'seconds')::numeric <= 0
           or (jsonb_typeof(w -> 'budget_tokens') is distinct from 'number'
               and jsonb_typeof(w -> 'budget_usd') is distinct from 'number') then
            perform fleet._raise('LF005', format('pool %s, window %s: needs seconds (> 0) and a budget_tokens or '
                                                 'budget_usd', p_name, k));
        end if;
    end loop;
    if v_reserve < 0 or v_reserve >= 1 then
        perform fleet._raise('LF005', format('pool %s: reserve must be at least 0 and below 1, not %s', p_name, v_reserve));
    end if;
    select * into v_old from fleet.pools where name = p_name for no key update;
    if not found then
        insert into fleet.pools (name, slots, windows, reserve) values (p_name, p_slots, v_windows, v_reserve);
        perform fleet._event('pool_created', null, null, null, jsonb_build_object('pool', p_name, 'slots', p_slots));
        return 'created';
    end if;
    if v_old.slots is not distinct from p_slots and v_old.windows = v_windows and v_old.reserve = v_reserve then
        return 'unchanged';
    end if;
    update fleet.pools set slots = p_slots, windows = v_windows, reserve = v_reserve, updated_at = now()
     where name = p_name;
    perform fleet._event('pool_updated', null, null, null, jsonb_build_object('pool', p_name, 'slots', p_slots,
        'windows', v_windows, 'reserve', v_reserve));
    return 'updated';
end
$$;
revoke all on function fleet.sync_pool(text,integer,jsonb,numeric) from public;
grant execute on function fleet.sync_pool(text,integer,jsonb,numeric) to service_role;

-- p_throttle_floor: the shortest pause a usage limit of a run under this profile gets
-- (fleet.throttle), in seconds: 0 up to fleet._longest_throttle().
create or replace function fleet.sync_profile(p_name text, p_pool text, p_models jsonb,
                                              p_throttle_floor double precision default 60)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_old fleet.profiles;
    v_floor double precision := coalesce(p_throttle_floor, 60);
begin
    if p_name is null or p_name !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a profile name', p_name),
            'lowercase letters, digits, - and _, 63 characters at most');
    end if;
    if p_models is null or jsonb_typeof(p_models) <> 'object' then
        perform fleet._raise('LF005', format('profile %s: models must be a JSON object (tier -> model)', p_name));
    end if;
    -- not (… and …): a NaN compares greater than every number, infinity included
    if not (v_floor >= 0 and v_floor <= extract(epoch from fleet._longest_throttle())) then
        perform fleet._raise('LF005', format('profile %s: throttle_floor must be 0 to %s seconds, not %s',
                                             p_name, extract(epoch from fleet._longest_throttle())::bigint, v_floor),
            'no pause is longer than the longest provider window (fleet._longest_throttle())');
    end if;
    if p_pool is not null and not exists (select 1 from fleet.pools where name = p_pool) then
        perform fleet._raise('LF005', format('profile %s draws from unknown pool %L', p_name, p_pool),
            'sync the pool first');
    end if;
    select * into v_old from fleet.profiles where name = p_name for no key update;
    if not found then
        insert into fleet.profiles (name, pool, models, throttle_floor_seconds) values (p_name, p_pool, p_models, v_floor);
        perform fleet._event('profile_created', null, null, null,
            jsonb_build_object('profile', p_name, 'pool', p_pool, 'models', p_models, 'throttle_floor_seconds', v_floor));
        return 'created';
    end if;
    if (v_old.pool, v_old.models, v_old.throttle_floor_seconds) is not distinct from (p_pool, p_models, v_floor) then
        return 'unchanged';
    end if;
    update fleet.profiles
       set pool = p_pool, models = p_models, throttle_floor_seconds = v_floor, updated_at = now()
     where name = p_name;
    perform fleet._event('profile_updated', null, null, null,
        jsonb_build_object('profile', p_name, 'pool', p_pool, 'models', p_models, 'throttle_floor_seconds', v_floor));
    return 'updated';
end
$$;
revoke all on function fleet.sync_profile(text,text,jsonb,double precision) from public;
grant execute on function fleet.sync_profile(text,text,jsonb,double precision) to service_role;

-- The longest pause a usage limit may put on a pool (and on its task): the longest window any
-- provider meters (a week) and a day's slack. fleet.throttle never pauses longer, whatever a
-- worker says, and no profile's throttle floor is longer (worker.shift.limits.LONGEST_RESET: the
-- worker does not believe a reset further ahead).
create or replace function fleet._longest_throttle()
returns interval
language sql
immutable
as $$
    select interval '8 days';
$$;
revoke all on function fleet._longest_throttle() from public;
grant execute on function fleet._longest_throttle() to service_role;

-- Who is calling, for the journal and for what a caller leaves behind (a pool's throttle): the
-- role the call runs as (PostgREST's SET ROLE, the key's role; else the login) and the key's
-- subject (its `sub` claim), when a key made the call.
create or replace function fleet._caller()
returns jsonb
language sql
stable
as $$
    select jsonb_strip_nulls(jsonb_build_object(
        'role', coalesce(nullif(nullif(current_setting('role', true), ''), 'none'), session_user::text),
        'key', nullif(current_setting('request.jwt.claims', true), '')::jsonb ->> 'sub'));
$$;
revoke all on function fleet._caller() from public;
grant execute on function fleet._caller() to service_role;

-- The profiles lane p_lane draws from: its own and those of its dispatch (the caller reads them
-- in its lane's row anyway).
create or replace function fleet._lane_profiles(p_lane text)
returns setof text
language sql
stable
as $$
    select distinct pf.name
      from fleet.lanes l
      join fleet.profiles pf
        on pf.name = l.config ->> 'profile'
        or pf.name in (select d ->> 'profile' from jsonb_array_elements(
                           case when jsonb_typeof(l.config -> 'dispatch') = 'array'
                                then l.config -> 'dispatch' else '[]' end) d)
     where l.name = p_lane;
$$;
revoke all on function fleet._lane_profiles(text) from public;
grant execute on function fleet._lane_profiles(text) to service_role;

-- Whether a task of lane p_lane may name profile p_profile: any profile, for a caller that works
-- every lane; else one of the lane's profiles. A key limited to some lanes cannot dispatch a
-- task with another lane's profile (and draw on that lane's pool), and learns of another lane's
-- profile what it learns of a profile that does not exist: "unknown profile".
create or replace function fleet._profile_known(p_lane text, p_profile text)
returns boolean
language sql
stable
as $$
    select case when fleet._allowed_lanes() is null
                then exists (select 1 from fleet.profiles where name = p_profile)
                else fleet._lane_allowed(p_lane) and p_profile in (select fleet._lane_profiles(p_lane))
           end;
$$;
revoke all on function fleet._profile_known(text,text) from public;
grant execute on function fleet._profile_known(text,text) to service_role;

-- The hint of an unknown profile, naming only profiles the caller may know of: every profile for
-- a caller that works every lane; else the profiles of lane p_lane (fleet._lane_profiles).
create or replace function fleet._profiles_hint(p_lane text)
returns text
language sql
stable
as $$
    select case
        when fleet._allowed_lanes() is null then
            'known profiles: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.profiles), 'none')
            || '; profiles come from fleet.toml by `fleet lanes sync`'
        else
            coalesce('the profiles of lane ' || p_lane || ': ' || (
                select string_agg(p, ', ' order by p) from fleet._lane_profiles(p_lane) p
                 where fleet._lane_allowed(p_lane)),
                'profiles come from fleet.toml by `fleet lanes sync`')
    end;
$$;
revoke all on function fleet._profiles_hint(text) from public;
grant execute on function fleet._profiles_hint(text) to service_role;

-- The lane's tiers, lowest first (empty: the lane has none).
-- (PL/pgSQL, as _tier_for: a SQL function with a subquery is never inlined, and it was parsed and
-- planned again in every statement that called it: the claim, each enqueue)
create or replace function fleet._tiers(l fleet.lanes)
returns text[]
language plpgsql
immutable
as $$
begin
    if jsonb_typeof(l.config -> 'tiers') = 'array' then
        return array(select jsonb_array_elements_text(l.config -> 'tiers'));
    end if;
    return '{}';
end
$$;
revoke all on function fleet._tiers(fleet.lanes) from public;
grant execute on function fleet._tiers(fleet.lanes) to service_role;

-- The tier an attempt runs at: the task's, if the lane has it; else the lane's default tier.
create or replace function fleet._tier_for(l fleet.lanes, p_tier text)
returns text
language plpgsql
immutable
as $$
declare
    v_tiers text[] := fleet._tiers(l);
begin
    if p_tier = any (v_tiers) then
        return p_tier;
    end if;
    return coalesce(l.config ->> 'default_tier', v_tiers[1]);
end
$$;
revoke all on function fleet._tier_for(fleet.lanes,text) from public;
grant execute on function fleet._tier_for(fleet.lanes,text) to service_role;

-- lanefleet: a batch's ship step is recorded before it runs (issue #10, item 4: ship once).
--
-- A shift that died after its `ship` command ran but before the outcome was recorded could not
-- tell, at takeover, whether the batch had shipped, and ran `ship` again blindly. Now the runner
-- records 'ship_started' (with the carrier's attempt) before it starts the command; a takeover
-- that finds it without a 'ship' outcome runs `ship` again with FLEET_BATCH_SHIP_RERUN=1, so the
-- command can look for what its earlier run made (an open pull request) instead of making it twice.
-- Otherwise batch_tail is as in 20261130140000_fleet_batches.sql.

create or replace function fleet.batch_tail(p_carrier bigint, p_token uuid, p_step text, p_outcome jsonb)
returns void
language plpgsql
as $$
declare
    b fleet.batches;
begin
    if p_step not in ('batch_verify', 'ship_started', 'ship') then
        perform fleet._raise('LF005', format('%L is not a step of a batch''s tail', p_step),
            'batch_verify, ship_started or ship');
    end if;
    if p_outcome is not null and jsonb_typeof(p_outcome) <> 'object' then
        perform fleet._raise('LF005', format('the outcome of %s must be a JSON object', p_step));
    end if;
    b := fleet._batch_fenced(p_carrier, p_token);
    if p_step = 'ship_started' then
        -- every start, kept: how many times the command was started is the evidence of a re-run
        update fleet.batches
           set report = report || jsonb_build_object('ship_started',
                   coalesce(report -> 'ship_started', '[]') || jsonb_build_array(
                       coalesce(p_outcome, '{}') || jsonb_build_object('at', now()))),
               current_n = null
         where id = b.id;
        perform fleet._event('batch_ship_started', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id, 'rerun', b.report ? 'ship_started') || coalesce(p_outcome, '{}'));
        return;
    end if;
    update fleet.batches set report = report || jsonb_build_object(p_step, p_outcome), current_n = null
     where id = b.id;
    if p_step = 'ship' then
        perform fleet._event('batch_shipped', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id) || coalesce(p_outcome, '{}'));
    end if;
end
$$;

comment on function fleet.batch_tail(bigint, uuid, text, jsonb) is
    'A step of a batch''s tail: batch_verify or ship with its outcome in the batch''s report, or ship_started '
    'recorded before the ship command runs (a takeover that finds it without a ship outcome re-runs ship '
    'with FLEET_BATCH_SHIP_RERUN=1). Fenced by the carrier''s lease.';

-- create or replace resets what the command does not say: the security settings of 20261130140000
alter function fleet.batch_tail(bigint, uuid, text, jsonb) security definer set search_path = pg_catalog, fleet, pg_temp;

notify pgrst, 'reload schema';

-- lanefleet: a batch member that must wait for a person leaves its batch blocked (issue #10 with
-- #9's task budgets).
--
-- A member whose task budget is spent (before its agent starts, or while it runs: the shift
-- stops the agent) cannot land and must not be retried into more spend. It leaves the batch like
-- an evicted member — nothing of it landed, the batch goes on — but its task is `blocked` with
-- the reason (no failure counted), and its run too, until `fleet resume TASK [--max-cost …]`
-- makes it an ordinary queued task again.

create or replace function fleet.batch_member_blocked(p_carrier bigint, p_token uuid, p_n int, p_reason text,
                                                      p_evidence text default null, p_usage jsonb default null)
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    t fleet.tasks;
begin
    if p_reason is null or p_reason !~ '^[a-z][a-z0-9-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a block reason', p_reason), 'e.g. budget');
    end if;
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state = 'evicted' and m.gate = p_reason then
        return 'blocked';  -- recorded already (a call repeated after a lost answer)
    end if;
    if m.state not in ('pending', 'running') then
        perform fleet._raise('LF004', format('member %s of batch %s is %s: it cannot be blocked', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set state = 'evicted', gate = p_reason, evidence = right(p_evidence, 4000), ended_at = now()
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, p_usage, 'blocked', null, p_reason);
    select * into t from fleet.tasks where id = m.task_id for no key update;
    update fleet.tasks
       set state = 'blocked', batch_id = null, block_reason = p_reason, updated_at = now(),
           last_error = left(format('blocked in batch %s (%s): %s', b.id, p_reason, p_evidence), 4000)
     where id = m.task_id;
    perform fleet._event('batch_evicted', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'gate', p_reason, 'to', 'blocked',
                           'evidence', right(p_evidence, 1000)));
    perform fleet._event('blocked', t.lane, m.task_id, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'reason', p_reason, 'evidence', right(p_evidence, 1000)));
    return 'blocked';
end
$$;

comment on function fleet.batch_member_blocked(bigint, uuid, int, text, text, jsonb) is
    'A member leaves its batch blocked (e.g. its task budget is spent): nothing of it landed, the batch goes '
    'on, its task and run are blocked with the reason (no failure counted) until `fleet resume`. Fenced by the '
    'carrier''s lease; p_usage: its agent''s report when the agent ran.';

alter function fleet.batch_member_blocked(bigint, uuid, int, text, text, jsonb)
    security definer set search_path = pg_catalog, fleet, pg_temp;
revoke execute on function fleet.batch_member_blocked(bigint, uuid, int, text, text, jsonb) from public;
grant execute on function fleet.batch_member_blocked(bigint, uuid, int, text, text, jsonb) to service_role, fleet_worker;

notify pgrst, 'reload schema';

-- Issues in, pull requests out: a source (an issue tracker, GitHub first) mirrors its items into
-- tasks, acts on what changed there outside the fleet (external advance), writes back once per
-- outcome, and judges a ci lane's tasks by their pull request's checks. The source's pass (Python,
-- worker/sources/) reads the tracker; every decision and every write is one of these functions.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- The source row, locked, of a key that may work every lane it feeds; LF005 for a source that
-- does not exist (or feeds a lane the key may not work: the same answer).
create or replace function fleet._source(p_source text)
returns fleet.sources
language plpgsql
as $$
declare
    s fleet.sources;
begin
    select * into s from fleet.sources where name = p_source for no key update;
    if not found or exists (select 1 from unnest(s.lanes) l where not fleet._lane_allowed(l)) then
        perform fleet._raise('LF005', format('unknown source %L', left(p_source, 100)),
            'a source is made by its first pass (`fleet sources sync`) from fleet.toml''s [sources.<name>]');
    end if;
    return s;
end
$$;
revoke all on function fleet._source(text) from public;
grant execute on function fleet._source(text) to service_role;

-- A pass begins: the source's row made or brought in step with the config (its kind and lanes),
-- and what the pass needs of it: {"resume_at", "cursor", "cache"}. Every lane must exist and be
-- one the caller's key may work.
create or replace function fleet.source_begin(p_source text, p_kind text, p_lanes text[])
returns jsonb
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_lane text;
    s fleet.sources;
begin
    if p_source is null or p_source !~ '^[a-z0-9][a-z0-9_-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a source name (lowercase letters, digits, - and _)',
                                             left(p_source, 100)));
    end if;
    if p_kind is null or p_kind not in ('github') then
        perform fleet._raise('LF005', format('%L is not a kind of source', p_kind), 'known: github');
    end if;
    if p_lanes is null or cardinality(p_lanes) = 0 then
        perform fleet._raise('LF005', format('source %s feeds no lane', p_source));
    end if;
    foreach v_lane in array p_lanes loop
        perform fleet._require_lane(v_lane);
        perform fleet._lane(v_lane);  -- LF002: it exists
    end loop;
    insert into fleet.sources (name, kind, lanes) values (p_source, p_kind, p_lanes)
    on conflict (name) do nothing;
    s := fleet._source(p_source);
    if s.kind <> p_kind or s.lanes is distinct from p_lanes then
        update fleet.sources set kind = p_kind, lanes = p_lanes, updated_at = now() where name = p_source;
    end if;
    return jsonb_build_object('resume_at', s.resume_at, 'cursor', s.cursor, 'cache', s.cache);
end
$$;
comment on function fleet.source_begin(text, text, text[]) is
    'A source''s pass begins: its row made or synced (kind, lanes); returns {resume_at, cursor, cache}.';
revoke all on function fleet.source_begin(text,text,text[]) from public;
grant execute on function fleet.source_begin(text,text,text[]) to fleet_operator, service_role;

-- A pass ends: the answers it read (merged into the cache by URL; a null value drops the entry),
-- the cursor it reached, until when the tracker must not be asked (NULL: ask at will), and what
-- went wrong, if anything.
create or replace function fleet.source_end(p_source text, p_cache jsonb, p_cursor timestamptz,
                                            p_resume_at timestamptz, p_error text default null)
returns void
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    s fleet.sources;
begin
    s := fleet._source(p_source);
    if p_cache is not null and jsonb_typeof(p_cache) <> 'object' then
        perform fleet._raise('LF005', 'the cache must be a JSON object of URLs');
    end if;
    update fleet.sources
       set cache = (select coalesce(jsonb_object_agg(e.url, e.entry), '{}')
                      from jsonb_each(cache || coalesce(p_cache, '{}')) e(url, entry)
                     where e.entry <> 'null'),
           cursor = greatest(cursor, p_cursor),
           resume_at = p_resume_at,
           passes = passes + 1, last_pass_at = now(), last_error = left(p_error, 2000), updated_at = now()
     where name = p_source;
end
$$;
revoke all on function fleet.source_end(text,jsonb,timestamptz,timestamptz,text) from public;
grant execute on function fleet.source_end(text,jsonb,timestamptz,timestamptz,text) to fleet_operator, service_role;

-- Mirror items into tasks (one page of a pass, in one transaction). Each item: {"ref", "key",
-- "lane", "open", "selected", "title", "payload", "priority", "tier", "profile", "url",
-- "updated_at"}. An open, selected item with no task becomes one (fleet.enqueue_task: its key, its
-- lane); one that was open and selected and is now closed or unselected cancels its live task
-- (external_advance, reason closed or unselected: a running agent stops at its next heartbeat);
-- one that was not and is again queues its done or cancelled task again (reason reopened; its
-- pull request let go, named in the event, so that the next attempt opens its own). Two
-- hosts syncing the same item at once: the row lock orders them and the second changes nothing.
-- Returns (ref, task_id, action, note): created | linked | updated | cancelled | requeued |
-- unchanged | ignored | refused (note: why the item cannot be a task of its lane; the rest go on).
create or replace function fleet.source_sync(p_source text, p_items jsonb)
returns table (ref text, task_id bigint, action text, note text)
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    s fleet.sources;
    e jsonb;
    n int := 0;
    i fleet.source_items;
    t fleet.tasks;
    v_was boolean;
    v_now boolean;
    v_task bigint;
    v_created boolean;
    v_action text;
    v_note text;
    v_where text;
begin
    s := fleet._source(p_source);
    if p_items is null or jsonb_typeof(p_items) <> 'array' then
        perform fleet._raise('LF005', 'source_sync needs a JSON array of items');
    end if;
    for e in select x from jsonb_array_elements(p_items) x loop
        v_where := format('source %s, item %s', p_source, n);
        n := n + 1;
        if jsonb_typeof(e) <> 'object' or jsonb_typeof(e -> 'ref') <> 'string' or jsonb_typeof(e -> 'key') <> 'string'
           or jsonb_typeof(e -> 'open') <> 'boolean' or jsonb_typeof(e -> 'selected') <> 'boolean' then
            perform fleet._raise('LF005', v_where || ': needs ref and key (strings), open and selected (booleans)');
        end if;
        v_now := (e ->> 'open')::boolean and (e ->> 'selected')::boolean;
        -- a selected item names its lane; one not selected (none of the source's labels) need not
        if (v_now or e ? 'lane') and not coalesce((e ->> 'lane') = any (s.lanes), false) then
            perform fleet._raise('LF005', format('%s (%s): lane %s is not one source %s feeds (%s)', v_where,
                                                 e ->> 'ref', coalesce(e ->> 'lane', 'null'), p_source,
                                                 array_to_string(s.lanes, ', ')));
        end if;
        if v_now then
            insert into fleet.source_items (source, ref, lane, open, selected)
            values (p_source, e ->> 'ref', e ->> 'lane', false, false)
            on conflict on constraint source_item_ref do nothing;
        end if;
        select * into i from fleet.source_items x where x.source = p_source and x.ref = e ->> 'ref' for update;
        if not found then  -- never selected: nothing to mirror, nothing kept
            ref := e ->> 'ref';
            task_id := null;
            action := 'ignored';
            note := null;
            return next;
            continue;
        end if;
        v_was := i.open and i.selected;
        v_action := 'unchanged';
        v_note := null;
        if i.task_id is null then
            if v_now then
                begin
                    select q.task_id, q.created into v_task, v_created
                      from fleet.enqueue_task(e ->> 'lane', e ->> 'key', coalesce(e -> 'payload', '{}'),
                                              coalesce((e ->> 'priority')::int, 0), now(), null, e ->> 'title',
                                              e ->> 'tier', e ->> 'profile') q;
                    -- (an item with no task yet goes where its labels say now)
                    update fleet.source_items x set task_id = v_task, lane = e ->> 'lane' where x.id = i.id;
                    v_action := case when v_created then 'created' else 'linked' end;
                exception when sqlstate 'LF002' or sqlstate 'LF005' or sqlstate 'LF009' then
                    -- this item cannot be a task of its lane (a payload too big, a tier the lane lacks, a
                    -- retired lane): said, and the others go on; the next pass that reads it tries again
                    get stacked diagnostics v_note = message_text;
                    v_task := null;
                    v_action := 'refused';
                end;
            else
                v_action := 'ignored';
            end if;
        else
            v_task := i.task_id;
            select * into t from fleet.tasks x where x.id = i.task_id for no key update;
            if v_was and not v_now and t.state in ('queued', 'running', 'blocked', 'ci', 'review') then
                perform fleet._cancel(t, 'external_advance', jsonb_build_object(
                    'reason', case when not (e ->> 'open')::boolean then 'closed' else 'unselected' end,
                    'source', p_source, 'ref', i.ref));
                v_action := 'cancelled';
            elsif v_now and not v_was and t.state in ('done', 'cancelled') then
                -- the pull request of the attempt before (merged, closed or open) is let go: the
                -- next attempt opens its own and is judged on it, not ended by the old one's merge.
                -- The journal keeps which it was; the item keeps its CI per SHA and a regression.
                perform fleet._requeue(t, 'external_advance', jsonb_build_object(
                    'reason', 'reopened', 'source', p_source, 'ref', i.ref)
                    || case when i.pr_number is null then '{}'::jsonb else jsonb_build_object(
                           'pr', i.pr_number, 'pr_url', i.pr_url, 'pr_state', i.pr_state, 'head_sha', i.head_sha,
                           'merged_sha', i.merged_sha, 'merged_at', i.merged_at, 'ci_fixes', i.ci_fixes) end);
                update fleet.source_items x
                   set pr_number = null, pr_url = null, pr_state = null, head_sha = null, merged_sha = null,
                       merged_at = null, ci_fixes = 0
                 where x.id = i.id;
                v_action := 'requeued';
            elsif v_now and t.state = 'queued' and t.attempts = 0
                  and (t.title is distinct from e ->> 'title' or t.payload is distinct from coalesce(e -> 'payload', '{}')) then
                -- edited in the tracker before any agent read it
                update fleet.tasks x set title = e ->> 'title', payload = coalesce(e -> 'payload', '{}'),
                                         updated_at = now()
                 where x.id = t.id;
                v_action := 'updated';
            end if;
        end if;
        -- (listed, it is there: an item the tracker once said was gone is not)
        update fleet.source_items x
           set open = (e ->> 'open')::boolean, selected = (e ->> 'selected')::boolean, url = e ->> 'url',
               item_updated_at = (e ->> 'updated_at')::timestamptz, gone_at = null, gone_reason = null,
               updated_at = now()
         where x.id = i.id;
        ref := i.ref;
        task_id := v_task;
        action := v_action;
        note := v_note;
        return next;
    end loop;
end
$$;
comment on function fleet.source_sync(text, jsonb) is
    'Mirror a source''s items into tasks: create, cancel (external_advance: closed, unselected), '
    'queue again (reopened) or update; (ref, task_id, action) per item in input order.';
revoke all on function fleet.source_sync(text,jsonb) from public;
grant execute on function fleet.source_sync(text,jsonb) to fleet_operator, service_role;

-- The source's items a pass has work for, one JSON object each: its task's state, what it ended
-- with (outcome: the journal event that put it there, the key a write-back of it is kept under),
-- its spend, its pull request and CI, what was posted. Work: a task running (the claim label), in
-- ci or review (its PR, its checks, a merge), blocked, done or dead with its outcome not written
-- back yet, merged within 7 days and not reverted (a regression to watch for), or done with its
-- pull request still open (its merge to be seen). Never an item gone from the tracker
-- (fleet.source_gone): there is nothing there to read or write back.
create or replace function fleet.source_work(p_source text)
returns table (item jsonb)
language plpgsql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    s fleet.sources;
begin
    select * into s from fleet.sources where name = p_source;
    if not found or exists (select 1 from unnest(s.lanes) l where not fleet._lane_allowed(l)) then
        perform fleet._raise('LF005', format('unknown source %L', left(p_source, 100)));
    end if;
    return query
    select jsonb_build_object(
               'ref', i.ref, 'lane', i.lane, 'url', i.url, 'open', i.open, 'selected', i.selected,
               'pr_state', i.pr_state,
               'task_id', t.id, 'key', t.key, 'title', t.title, 'task_lane', t.lane, 'state', t.state, 'attempts', t.attempts,
               'block_reason', t.block_reason, 'dead_reason', t.dead_reason, 'last_error', right(t.last_error, 2000),
               'result', t.result, 'pr_number', i.pr_number, 'pr_url', i.pr_url, 'head_sha', i.head_sha,
               'merged_sha', i.merged_sha, 'merged_at', i.merged_at, 'ci', i.ci, 'ci_fixes', i.ci_fixes,
               'posts', i.posts,
               'outcome', o.outcome,
               'spend', (select jsonb_build_object(
                                'runs', count(*), 'cost_usd', coalesce(sum(r.cost_usd), 0),
                                'input_tokens', coalesce(sum(r.input_tokens), 0),
                                'output_tokens', coalesce(sum(r.output_tokens), 0),
                                'cache_read_tokens', coalesce(sum(r.cache_read_tokens), 0),
                                'cache_creation_tokens', coalesce(sum(r.cache_creation_tokens), 0))
                           from fleet.runs r where r.task_id = t.id))
      from fleet.source_items i
      join fleet.tasks t on t.id = i.task_id
      left join lateral (
          select jsonb_build_object('id', ev.id, 'kind', ev.kind, 'detail', ev.detail,
                                    'key', t.state || ':' || ev.id) as outcome
            from fleet.journal ev
           where ev.task_id = t.id
             and ev.kind in ('completed', 'failed', 'blocked', 'repaired', 'ci_passed', 'ci_failed',
                             'external_advance', 'review_approved', 'claimed')
           order by ev.id desc limit 1) o on true
     where i.source = p_source
       and fleet._lane_allowed(t.lane)
       and i.gone_at is null
       and (t.state in ('running', 'ci', 'review', 'blocked')
            or (t.state = 'queued' and i.pr_number is not null)  -- back to its agent after a red CI
            or (t.state in ('done', 'dead') and t.finished_at > now() - interval '30 days'
                and not coalesce(i.posts ? (o.outcome ->> 'key'), false))
            or (i.merged_at > now() - interval '7 days' and i.reverted_at is null)
            -- done with its pull request open: a merge to come starts the 7 days a revert counts
            or (t.state = 'done' and i.pr_number is not null and i.merged_at is null
                and i.pr_state is distinct from 'closed' and t.finished_at > now() - interval '30 days'))
     order by i.id;
end
$$;
comment on function fleet.source_work(text) is
    'The items of a source its pass has work for (a PR to open or watch, CI to judge, an outcome to '
    'write back, a merge to watch for a revert): one JSON object each.';
revoke all on function fleet.source_work(text) from public;
grant execute on function fleet.source_work(text) to fleet_operator, service_role;

-- The source item of a task, locked (LF005 for an item the source does not have).
create or replace function fleet._source_item(p_source text, p_ref text)
returns fleet.source_items
language plpgsql
as $$
declare
    i fleet.source_items;
begin
    perform fleet._source(p_source);
    select * into i from fleet.source_items where source = p_source and ref = p_ref for update;
    if not found or not fleet._lane_allowed(i.lane) then
        perform fleet._raise('LF005', format('source %s has no item %L', p_source, left(p_ref, 300)));
    end if;
    return i;
end
$$;
revoke all on function fleet._source_item(text,text) from public;
grant execute on function fleet._source_item(text,text) to service_role;

-- A write-back is made (a comment posted, a label set): kept under p_key (e.g. running:<event id>,
-- done:<event id>) with what the tracker answered (the comment's id), so that no pass posts it
-- again. 'recorded', or 'already' when another pass recorded it first.
create or replace function fleet.source_posted(p_source text, p_ref text, p_key text, p_value jsonb default 'true')
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    i fleet.source_items;
begin
    i := fleet._source_item(p_source, p_ref);
    if p_key is null or length(p_key) = 0 or length(p_key) > 200 then
        perform fleet._raise('LF005', 'a write-back key must be 1 to 200 characters');
    end if;
    if i.posts ? p_key then
        return 'already';
    end if;
    update fleet.source_items
       set posts = posts || jsonb_build_object(p_key, coalesce(p_value, 'true')), updated_at = now()
     where id = i.id;
    return 'recorded';
end
$$;
revoke all on function fleet.source_posted(text,text,text,jsonb) from public;
grant execute on function fleet.source_posted(text,text,text,jsonb) to fleet_operator, service_role;

-- What the tracker says of the task's pull request: {"number", "url", "head_sha", "state" (open |
-- closed), "merged_sha", "merged_at"}. Merged with its task still live (queued, running, blocked,
-- ci, review): the task is done (external_advance, reason merged; a running agent stops at its
-- next heartbeat). Closed unmerged while the task waits in ci: blocked (pr-closed) for a person.
-- Returns the task's state.
create or replace function fleet.source_pr(p_source text, p_ref text, p_pr jsonb)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    i fleet.source_items;
    t fleet.tasks;
    v_merged_at timestamptz;
begin
    i := fleet._source_item(p_source, p_ref);
    if p_pr is null or jsonb_typeof(p_pr -> 'number') <> 'number' then
        perform fleet._raise('LF005', format('source %s, item %s: a pull request needs its number', p_source, p_ref));
    end if;
    v_merged_at := (p_pr ->> 'merged_at')::timestamptz;
    update fleet.source_items
       set pr_number = (p_pr ->> 'number')::int, pr_url = coalesce(p_pr ->> 'url', pr_url),
           pr_state = coalesce(p_pr ->> 'state', pr_state),
           head_sha = coalesce(p_pr ->> 'head_sha', head_sha),
           merged_sha = coalesce(merged_sha, p_pr ->> 'merged_sha'),
           merged_at = coalesce(merged_at, v_merged_at), updated_at = now()
     where id = i.id;
    if i.task_id is null then
        return null;
    end if;
    select * into t from fleet.tasks where id = i.task_id for no key update;
    if v_merged_at is not null and t.state in ('queued', 'running', 'blocked', 'ci', 'review') then
        update fleet.tasks
           set state = 'done', finished_at = now(), updated_at = now(), carry_over = false,
               block_reason = null, verify_pending = false, ci_feedback = null,
               result = coalesce(result, '{}') || jsonb_build_object('merged_sha', p_pr ->> 'merged_sha',
                                                                     'pr', (p_pr ->> 'number')::int),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = t.id;
        if t.state = 'running' then
            perform fleet._end_run(t.lease_token, 'cancelled');
        end if;
        perform fleet._event('external_advance', t.lane, t.id, t.session_id, jsonb_build_object(
            'reason', 'merged', 'source', p_source, 'ref', p_ref, 'was', t.state,
            'pr', (p_pr ->> 'number')::int, 'merged_sha', p_pr ->> 'merged_sha'));
        return 'done';
    end if;
    if v_merged_at is null and p_pr ->> 'state' = 'closed' and t.state = 'ci' then
        update fleet.tasks set state = 'blocked', block_reason = 'pr-closed', updated_at = now() where id = t.id;
        perform fleet._event('blocked', t.lane, t.id, null, jsonb_build_object(
            'reason', 'pr-closed', 'evidence', format('pull request #%s was closed without a merge', p_pr ->> 'number')));
        return 'blocked';
    end if;
    return t.state;
end
$$;
revoke all on function fleet.source_pr(text,text,jsonb) from public;
grant execute on function fleet.source_pr(text,text,jsonb) to fleet_operator, service_role;

-- The tracker will not open the pull request of a task waiting in ci: p_reason no-commits (its
-- branch has nothing its base lacks: the agent changed nothing) or pr-refused (another refusal:
-- the branch not there, …), p_evidence the tracker's words. The task is blocked with that reason
-- for a person (`fleet resume` sends it back to its agent, `fleet cancel` ends it); asking again
-- each pass would get the same answer. Returns 'blocked', or 'stale' (the task is not in ci).
create or replace function fleet.source_pr_refused(p_source text, p_ref text, p_reason text, p_evidence text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    i fleet.source_items;
    t fleet.tasks;
begin
    i := fleet._source_item(p_source, p_ref);
    if p_reason is null or p_reason not in ('no-commits', 'pr-refused') then
        perform fleet._raise('LF005', format('%L is not a reason a pull request was refused', p_reason),
            'no-commits or pr-refused');
    end if;
    if i.task_id is null then
        return 'stale';
    end if;
    select * into t from fleet.tasks where id = i.task_id for no key update;
    if t.state <> 'ci' then
        return 'stale';
    end if;
    update fleet.tasks
       set state = 'blocked', block_reason = p_reason, last_error = left(p_evidence, 4000), updated_at = now()
     where id = t.id;
    perform fleet._event('blocked', t.lane, t.id, null, jsonb_build_object(
        'reason', p_reason, 'source', p_source, 'ref', p_ref, 'evidence', right(p_evidence, 1000)));
    return 'blocked';
end
$$;
comment on function fleet.source_pr_refused(text, text, text, text) is
    'The tracker will not open the pull request of a task in ci (no-commits, pr-refused): blocked for a person.';
revoke all on function fleet.source_pr_refused(text,text,text,text) from public;
grant execute on function fleet.source_pr_refused(text,text,text,text) to fleet_operator, service_role;

-- The tracker says the item is not there any more (GitHub: deleted, transferred to another
-- repository): p_why its answer. The item is marked gone (gone_at, gone_reason; no longer open
-- nor selected), so that no pass has work for it again (fleet.source_work leaves it out) unless a
-- listing shows it again (fleet.source_sync); its live task is cancelled (external_advance,
-- reason gone: a running agent stops at its next heartbeat), a finished one keeps its state
-- (journal: source_item_gone). Returns the task's state (NULL: no task), or 'already'.
create or replace function fleet.source_gone(p_source text, p_ref text, p_why text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    i fleet.source_items;
    t fleet.tasks;
    v_detail jsonb;
begin
    i := fleet._source_item(p_source, p_ref);
    if p_why is null or length(btrim(p_why)) = 0 then
        perform fleet._raise('LF005', format('source %s, item %s: say why it is gone (the tracker''s answer)',
                                             p_source, left(p_ref, 300)));
    end if;
    if i.gone_at is not null then
        return 'already';
    end if;
    update fleet.source_items
       set gone_at = now(), gone_reason = left(p_why, 500), open = false, selected = false, updated_at = now()
     where id = i.id;
    if i.task_id is null then
        return null;
    end if;
    select * into t from fleet.tasks where id = i.task_id for no key update;
    v_detail := jsonb_build_object('source', p_source, 'ref', p_ref, 'why', left(p_why, 500));
    if t.state in ('queued', 'running', 'blocked', 'ci', 'review') then
        return fleet._cancel(t, 'external_advance', jsonb_build_object('reason', 'gone') || v_detail);
    end if;
    perform fleet._event('source_item_gone', t.lane, t.id, null, jsonb_build_object('state', t.state) || v_detail);
    return t.state;
end
$$;
comment on function fleet.source_gone(text, text, text) is
    'A source''s item is not in the tracker any more (deleted, transferred): marked gone, its live task cancelled.';
revoke all on function fleet.source_gone(text,text,text) from public;
grant execute on function fleet.source_gone(text,text,text) to fleet_operator, service_role;

-- The checks of the task's pull request at head p_sha, as the pass read them: p_runs workflow runs,
-- p_verdict pending | success | failure (p_evidence: the failing checks' names and their logs'
-- tails). Recorded per SHA (CI executions and cycles, fleet.cohort_metrics). A task in ci:
-- success → done (or review, where the lane reviews); failure → queued
-- again with the evidence in its next prompt (tasks.ci_feedback), at most the lane's max_ci_fixes
-- times (default 3), then blocked (ci-failed) for a person. Returns the task's state, or 'stale'
-- (the task is not in ci: another pass judged it first).
create or replace function fleet.source_ci(p_source text, p_ref text, p_sha text, p_runs int, p_verdict text,
                                           p_evidence text default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    i fleet.source_items;
    t fleet.tasks;
    l fleet.lanes;
    v_max int;
begin
    i := fleet._source_item(p_source, p_ref);
    if p_sha is null or p_sha !~ '^[0-9a-f]{7,64}$' then
        perform fleet._raise('LF005', format('%L is not a commit SHA', left(p_sha, 80)));
    end if;
    if p_verdict is null or p_verdict not in ('pending', 'success', 'failure') then
        perform fleet._raise('LF005', format('%L is not a CI verdict', p_verdict), 'pending, success or failure');
    end if;
    update fleet.source_items
       set ci = ci || jsonb_build_object(p_sha, jsonb_build_object(
                'runs', greatest(coalesce(p_runs, 0), coalesce((ci -> p_sha ->> 'runs')::int, 0)),
                'verdict', coalesce(ci -> p_sha ->> 'verdict', nullif(p_verdict, 'pending')))),
           head_sha = p_sha, updated_at = now()
     where id = i.id;
    if i.task_id is null then
        return 'stale';
    end if;
    select * into t from fleet.tasks where id = i.task_id for no key update;
    -- (a SHA judged before and the task in ci again: its agent's next attempt pushed nothing new,
    -- and the same checks judge it again)
    if t.state <> 'ci' then
        return 'stale';
    end if;
    if p_verdict = 'pending' then
        return 'ci';
    end if;
    select * into l from fleet.lanes where name = t.lane;
    if p_verdict = 'success' then
        update fleet.tasks
           set state = case when coalesce((l.config ->> 'review')::boolean, false) then 'review' else 'done' end,
               finished_at = case when coalesce((l.config ->> 'review')::boolean, false) then null else now() end,
               ci_feedback = null, updated_at = now()
         where id = t.id;
        perform fleet._event('ci_passed', t.lane, t.id, null, jsonb_build_object(
            'source', p_source, 'ref', p_ref, 'sha', p_sha, 'runs', p_runs, 'fixes', i.ci_fixes));
        return (select state from fleet.tasks where id = t.id);
    end if;
    v_max := coalesce((l.config ->> 'max_ci_fixes')::int, 3);
    if i.ci_fixes >= v_max then
        update fleet.tasks
           set state = 'blocked', block_reason = 'ci-failed', last_error = left(p_evidence, 4000),
               ci_feedback = left(p_evidence, 8000), updated_at = now()
         where id = t.id;
        perform fleet._event('blocked', t.lane, t.id, null, jsonb_build_object(
            'reason', 'ci-failed', 'sha', p_sha, 'fixes', i.ci_fixes, 'evidence', right(p_evidence, 1000)));
        return 'blocked';
    end if;
    update fleet.source_items set ci_fixes = ci_fixes + 1 where id = i.id;
    update fleet.tasks
       set state = 'queued', run_at = now(), ci_feedback = left(p_evidence, 8000), result = null, updated_at = now()
     where id = t.id;
    perform fleet._event('ci_failed', t.lane, t.id, null, jsonb_build_object(
        'source', p_source, 'ref', p_ref, 'sha', p_sha, 'runs', p_runs, 'fix', i.ci_fixes + 1, 'of', v_max,
        'evidence', right(p_evidence, 1000)));
    return 'queued';
end
$$;
revoke all on function fleet.source_ci(text,text,text,int,text,text) from public;
grant execute on function fleet.source_ci(text,text,text,int,text,text) to fleet_operator, service_role;

-- A commit on the base branch reverts the task's merge (GitHub's "This reverts commit <sha>."):
-- within 7 days of the merge it counts as the task's regression (journal: regression). Returns
-- 'recorded', 'already' or 'late' (past the 7 days: not a regression of this task).
create or replace function fleet.source_reverted(p_source text, p_ref text, p_revert_sha text,
                                                 p_reverted_at timestamptz)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    i fleet.source_items;
begin
    i := fleet._source_item(p_source, p_ref);
    if i.reverted_at is not null then
        return 'already';
    end if;
    if i.merged_at is null or p_reverted_at is null or p_reverted_at > i.merged_at + interval '7 days' then
        return 'late';
    end if;
    update fleet.source_items set reverted_at = p_reverted_at, revert_sha = p_revert_sha, updated_at = now()
     where id = i.id;
    perform fleet._event('regression', i.lane, i.task_id, null, jsonb_build_object(
        'source', p_source, 'ref', p_ref, 'merged_sha', i.merged_sha, 'revert_sha', p_revert_sha,
        'after_seconds', extract(epoch from p_reverted_at - i.merged_at)));
    return 'recorded';
end
$$;
revoke all on function fleet.source_reverted(text,text,text,timestamptz) from public;
grant execute on function fleet.source_reverted(text,text,text,timestamptz) to fleet_operator, service_role;

-- lanefleet: the schema. Tables of DESIGN §3 and the constraints that keep them honest.
--
-- Every state transition lives in a plpgsql function (next migration); these tables only
-- refuse states that can never be right (a running task without a lease, a negative counter).

create schema if not exists fleet;

comment on schema fleet is 'lanefleet: a multi-lane task queue; the database is the scheduler';

-- A lane: a class of work with its own slots and limits, synced from fleet.toml.
create table fleet.lanes (
    name text primary key
        constraint lane_name_format check (name ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    max_running int constraint max_running_non_negative check (max_running is null or max_running >= 0),
    lease_seconds int not null default 60
        constraint lease_seconds_range check (lease_seconds between 3 and 86400),
    max_attempts int not null default 3 constraint max_attempts_positive check (max_attempts >= 1),
    max_handoffs int not null default 10 constraint max_handoffs_non_negative check (max_handoffs >= 0),
    -- a session whose heartbeat is older than this is lost (NULL: the lane's lease_seconds)
    session_timeout_seconds int constraint session_timeout_positive
        check (session_timeout_seconds is null or session_timeout_seconds > 0),
    -- retry backoff after a failure: base * 2^(failures-1), capped
    backoff_base_seconds int not null default 10 constraint backoff_base_non_negative
        check (backoff_base_seconds >= 0),
    backoff_max_seconds int not null default 3600 constraint backoff_max_non_negative
        check (backoff_max_seconds >= 0),
    -- lanes allowed to route into this one (NULL: any lane)
    accepts_from text[],
    paused boolean not null default false,
    config jsonb not null default '{}' constraint lane_config_object check (jsonb_typeof(config) = 'object'),
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now()
);

-- One row per shift (a worker process of one lane).
create table fleet.sessions (
    id uuid primary key default gen_random_uuid(),
    lane text not null references fleet.lanes (name) on update cascade,
    host text not null constraint session_host_not_empty check (host <> ''),
    pid int not null constraint session_pid_positive check (pid > 0),
    pid_started_at timestamptz,
    started_at timestamptz not null default now(),
    heartbeat_at timestamptz not null default now(),
    deadline timestamptz not null,
    ended_at timestamptz,
    end_reason text,
    state text not null default 'active'
        constraint session_state check (state in ('active', 'ended', 'lost')),
    constraint session_ended_consistent check ((state = 'active') = (ended_at is null))
);

create index sessions_active_lane on fleet.sessions (lane) where state = 'active';
create index sessions_active_heartbeat on fleet.sessions (heartbeat_at) where state = 'active';
create index sessions_active_host on fleet.sessions (host) where state = 'active';
create index sessions_started on fleet.sessions (started_at);

create table fleet.tasks (
    id bigint generated always as identity primary key,
    lane text not null references fleet.lanes (name) on update cascade,
    key text not null constraint task_key_unique unique
        constraint task_key_length check (length(key) between 1 and 200),
    title text,
    payload jsonb not null default '{}' constraint task_payload_object check (jsonb_typeof(payload) = 'object'),
    priority int not null default 0 constraint task_priority_range check (priority between 0 and 1000),
    state text not null default 'queued'
        constraint task_state check (state in ('queued', 'running', 'done', 'dead', 'cancelled')),
    run_at timestamptz not null default now(),
    -- set by a hand-off: the next claim of the lane takes this task before others of its priority
    resume boolean not null default false,
    attempts int not null default 0 constraint attempts_non_negative check (attempts >= 0),
    failures int not null default 0 constraint failures_non_negative check (failures >= 0),
    evaporations int not null default 0 constraint evaporations_non_negative check (evaporations >= 0),
    handoffs int not null default 0 constraint handoffs_non_negative check (handoffs >= 0),
    max_attempts int constraint task_max_attempts_positive check (max_attempts is null or max_attempts >= 1),
    last_progress_at timestamptz,
    lease_token uuid,
    lease_expires_at timestamptz,
    session_id uuid references fleet.sessions (id),
    agent_session text,
    checkpoint jsonb,
    checkpoint_seq int not null default 0 constraint checkpoint_seq_non_negative check (checkpoint_seq >= 0),
    handoff jsonb,            -- the last hand-off snapshot of this task
    stages jsonb not null default '[]' constraint task_stages_array check (jsonb_typeof(stages) = 'array'),
    last_error text,
    dead_reason text,
    result jsonb,
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now(),
    finished_at timestamptz,
    -- running <=> leased to a session
    constraint running_has_lease check (
        (state = 'running') = (lease_token is not null)
        and (state = 'running') = (lease_expires_at is not null)
        and (state = 'running') = (session_id is not null)),
    constraint finished_has_time check ((state in ('done', 'dead', 'cancelled')) = (finished_at is not null))
);

-- The claim's ORDER BY, on queued rows only.
create index tasks_ready on fleet.tasks (lane, priority desc, resume desc, run_at, id) where state = 'queued';
-- The monitor: expired leases, and the tasks a session holds.
create index tasks_running_lease on fleet.tasks (lease_expires_at) where state = 'running';
create index tasks_running_session on fleet.tasks (session_id) where state = 'running';
create index tasks_running_lane on fleet.tasks (lane) where state = 'running';
-- Dashboards and listings.
create index tasks_lane_state on fleet.tasks (lane, state);
create index tasks_finished on fleet.tasks (finished_at) where finished_at is not null;

-- One row per dispatch (claim) of a task: what ran, how it ended, what it cost.
create table fleet.runs (
    id bigint generated always as identity primary key,
    task_id bigint not null references fleet.tasks (id) on delete cascade,
    session_id uuid references fleet.sessions (id),
    lane text not null,
    attempt int not null constraint run_attempt_positive check (attempt >= 1),
    lease_token uuid not null constraint run_lease_token_unique unique,
    started_at timestamptz not null default now(),
    ended_at timestamptz,
    outcome text constraint run_outcome check (outcome in
        ('done', 'failed', 'dead', 'handed_off', 'routed', 'lost', 'cancelled')),
    exit_code int,
    tier text,
    model text,
    agent_session text,
    input_tokens bigint not null default 0 constraint input_tokens_non_negative check (input_tokens >= 0),
    cache_creation_tokens bigint not null default 0
        constraint cache_creation_tokens_non_negative check (cache_creation_tokens >= 0),
    cache_read_tokens bigint not null default 0
        constraint cache_read_tokens_non_negative check (cache_read_tokens >= 0),
    output_tokens bigint not null default 0 constraint output_tokens_non_negative check (output_tokens >= 0),
    cost_usd numeric(14, 6) not null default 0 constraint cost_non_negative check (cost_usd >= 0),
    log_path text,
    error_tail text,
    constraint run_ended_consistent check ((outcome is null) = (ended_at is null))
);

create index runs_task on fleet.runs (task_id, id);
create index runs_session on fleet.runs (session_id);
create index runs_open on fleet.runs (session_id) where ended_at is null;
create index runs_started on fleet.runs (started_at);

-- The snapshot a shift leaves at exit, for the next shift of its lane and for operators.
create table fleet.lane_handoffs (
    id bigint generated always as identity primary key,
    lane text not null references fleet.lanes (name) on update cascade,
    session_id uuid not null constraint lane_handoff_session_unique unique references fleet.sessions (id),
    window_start timestamptz not null,
    window_end timestamptz not null,
    end_reason text,
    counts jsonb not null,
    completed bigint[] not null default '{}',
    failed bigint[] not null default '{}',
    handed_off bigint[] not null default '{}',
    tokens jsonb not null,
    cost_usd numeric(14, 6) not null default 0,
    notes jsonb not null default '{}',
    queue_head jsonb not null default '[]',
    created_at timestamptz not null default now()
);

create index lane_handoffs_lane on fleet.lane_handoffs (lane, id desc);

-- The append-only journal: one row per transition, written in the same transaction.
create table fleet.events (
    id bigint generated always as identity primary key,
    ts timestamptz not null default now(),
    kind text not null,
    lane text,
    task_id bigint,
    session_id uuid,
    detail jsonb not null default '{}'
);

create index events_task on fleet.events (task_id, id) where task_id is not null;
create index events_session on fleet.events (session_id, id) where session_id is not null;
create index events_kind_ts on fleet.events (kind, ts);
create index events_ts on fleet.events (ts);

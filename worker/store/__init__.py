"""The queue client: the Store protocol, its two back-ends (PostgreSQL, Supabase's REST API), their reads and keys, and the task input they are given."""

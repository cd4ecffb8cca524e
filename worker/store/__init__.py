"""The queue client: the Store protocol and its two back-ends (PostgreSQL, Supabase's REST API), with what they share."""

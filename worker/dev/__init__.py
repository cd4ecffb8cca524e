"""Development tooling, apart from runtime code: the local Supabase stack and the scripted example agent."""

"""Task workspaces: the folder an agent works in, its disk use and removal, and its git worktree."""

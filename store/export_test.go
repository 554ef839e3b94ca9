package store

import "github.com/hashicorp/raft"

// SetLogWrapper makes every store opened until the returned func is called
// put wrap(dir, log) under its verifier and log cache, dir being the
// store's raft directory.
func SetLogWrapper(wrap func(dir string, log raft.LogStore) raft.LogStore) (undo func()) {
	wrapLog.Store(&wrap)
	return func() { wrapLog.Store(nil) }
}

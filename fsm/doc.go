// Package fsm is the replicated state machine of the PiVirt agent: the
// raft.FSM that every node applies committed Raft log entries to.
//
// The state lives in a go-memdb database (tables services, config,
// config_history, schedules, schedule_runs, ca, placements, dedupe,
// sessions and index, see
// [Tables]; plus service_index, derived on each node and never in
// snapshots).
// [FSM.Apply] decodes a command ([Decode]), dispatches it to the apply
// function of its operation and commits all its changes in one memdb write
// transaction; [FSM.ApplyBatch] (raft.BatchingFSM) does the same for a batch
// of entries in one transaction, with the results and the state that
// applying them one at a time gives. Apply is deterministic: it reads no
// clock, no randomness and no environment — time comes from the
// leader-stamped [fsmv1.Command] time and indexes from the Raft log index —
// so every node that applies the same log holds the same state, byte for
// byte in its snapshots, however raft batches the entries.
//
// Readers take a [State], a read-only view of one memdb read transaction, and
// may block on changes through memdb watch sets (blocking queries). A restore
// from a snapshot replaces the whole database and closes the abandon channel
// of the old one ([FSM.AbandonCh], [State.AbandonCh]), so watchers re-list.
//
// Every write with a client ID leaves its outcome in its client's session
// for the dedupe window: a repeat of the write (a retry through another
// agent after a leader change) changes nothing and answers with that
// outcome ([State.WriteOutcome]); a repeat whose outcome was dropped gets
// [ErrTooOldToReplay] instead of being applied twice, and a session idle
// for the window expires. etcd mode keeps a dedupe record per write
// instead. Snapshots ([FSM.Snapshot], [FSM.Restore]) are a
// versioned stream of every table; [FilterSnapshot] copies one without
// given tables (archives leave the cluster CA out). Package fsmtest has a
// state with records in every table for the tests of the packages that
// store or move it.
//
// See DESIGN.md in this directory for the reasoning and the invariants.
package fsm

// Package fsm is the replicated state machine of the PiVirt agent: the
// raft.FSM that every node applies committed Raft log entries to.
//
// The state lives in a go-memdb database (tables services, config,
// config_history, schedules, schedule_runs, dedupe and index, see [Tables]).
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
// See DESIGN.md in this directory for the reasoning and the invariants.
package fsm

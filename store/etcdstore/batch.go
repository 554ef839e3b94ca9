package etcdstore

import (
	"context"
	"errors"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"pilab.hu/pivirt-agent/store"
)

// Writes that reach etcd while another transaction of this agent is in
// flight wait for it and then go together, as the nested transactions of
// one etcd transaction: each keeps its own compares and succeeds or fails
// on its own, and all that succeed are linearized at the one revision.
// One round trip and one Raft entry of etcd carry many writes (DESIGN.md,
// "Writes"). A lone write is sent as soon as it comes, as a plain
// transaction.
const (
	// maxBatch bounds the writes of one transaction: etcd's --max-txn-ops
	// (128 by default) counts each nested transaction as one operation.
	maxBatch = 64
	// maxBatchBytes bounds the values of one batched transaction, well
	// below etcd's default --max-request-bytes (1.5 MiB); a write larger
	// than this goes alone.
	maxBatchBytes = 512 << 10
)

// txnReq is a write waiting for its transaction.
type txnReq struct {
	keys map[string]bool // every key compared or written
	cmps []clientv3.Cmp
	ops  []clientv3.Op
	size int
	done chan txnRes // buffered: the batcher never blocks on it
}

// txnRes is the outcome of one write of a batch: the revision etcd
// answered with, whether its compares held, or the error of the
// transaction.
type txnRes struct {
	rev int64
	ok  bool
	err error
}

// txn commits ops under cmps, batched with the concurrent writes of this
// agent whose keys it shares none of (keys: every key cmps compare or ops
// write). It returns the revision, whether the compares held, and etcd's
// error as a lone transaction would.
func (s *Store) txn(ctx context.Context, keys []string, cmps []clientv3.Cmp, ops []clientv3.Op, size int) (int64, bool, error) {
	r := &txnReq{keys: make(map[string]bool, len(keys)), cmps: cmps, ops: ops, size: size, done: make(chan txnRes, 1)}
	for _, k := range keys {
		r.keys[k] = true
	}
	s.batchMu.Lock()
	if s.batchClosed {
		s.batchMu.Unlock()
		return 0, false, store.ErrShutdown
	}
	s.queue = append(s.queue, r)
	if !s.committing {
		s.committing = true
		s.batchWG.Add(1)
		go s.commitBatches()
	}
	s.batchMu.Unlock()
	select {
	case res := <-r.done:
		return res.rev, res.ok, res.err
	case <-ctx.Done():
		// Its transaction may still be sent, or be on its way: the
		// outcome is unknown, as after a lost answer.
		return 0, false, ctx.Err()
	}
}

// commitBatches sends the queued writes, a batch at a time, until the
// queue is empty.
func (s *Store) commitBatches() {
	defer s.batchWG.Done()
	for {
		s.batchMu.Lock()
		batch := s.takeBatch()
		if len(batch) == 0 {
			s.committing = false
			s.batchMu.Unlock()
			return
		}
		s.batchMu.Unlock()
		s.sendBatch(batch)
	}
}

// takeBatch removes from the queue, in order, the writes that share no key
// with a write taken before them, up to maxBatch and maxBatchBytes (the
// first is always taken). batchMu must be held.
func (s *Store) takeBatch() []*txnReq {
	if len(s.queue) == 0 {
		return nil
	}
	var (
		batch []*txnReq
		rest  = s.queue[:0]
		taken = map[string]bool{}
		bytes int
	)
	for _, r := range s.queue {
		fits := len(batch) == 0 || (len(batch) < maxBatch && bytes+r.size <= maxBatchBytes && disjoint(taken, r.keys))
		if !fits {
			rest = append(rest, r)
			continue
		}
		batch = append(batch, r)
		bytes += r.size
		for k := range r.keys {
			taken[k] = true
		}
	}
	clear(s.queue[len(rest):])
	s.queue = rest
	return batch
}

func disjoint(a, b map[string]bool) bool {
	for k := range b {
		if a[k] {
			return false
		}
	}
	return true
}

// sendBatch commits a batch and answers each of its writes. A batch whose
// transaction etcd refuses for what one of its writes holds (too large, a
// lease that expired) is sent again one write at a time, so that each
// gets its own answer.
func (s *Store) sendBatch(batch []*txnReq) {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
	defer cancel()
	if len(batch) == 1 {
		r := batch[0]
		resp, err := s.cli.Txn(ctx).If(r.cmps...).Then(r.ops...).Commit()
		r.done <- outcome(resp, err)
		return
	}
	nested := make([]clientv3.Op, len(batch))
	for i, r := range batch {
		nested[i] = clientv3.OpTxn(r.cmps, r.ops, nil)
	}
	resp, err := s.cli.Txn(ctx).Then(nested...).Commit()
	switch {
	case errors.Is(err, rpctypes.ErrLeaseNotFound), errors.Is(err, rpctypes.ErrRequestTooLarge),
		errors.Is(err, rpctypes.ErrTooManyOps), errors.Is(err, rpctypes.ErrDuplicateKey):
		for _, r := range batch {
			s.sendBatch([]*txnReq{r})
		}
		return
	case err != nil:
		for _, r := range batch {
			r.done <- txnRes{err: err}
		}
		return
	}
	for i, r := range batch {
		res := txnRes{rev: resp.Header.Revision}
		if i < len(resp.Responses) {
			if t := resp.Responses[i].GetResponseTxn(); t != nil {
				res.ok = t.GetSucceeded()
			}
		}
		r.done <- res
	}
}

func outcome(resp *clientv3.TxnResponse, err error) txnRes {
	if err != nil {
		return txnRes{err: err}
	}
	return txnRes{rev: resp.Header.Revision, ok: resp.Succeeded}
}

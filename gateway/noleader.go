package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/store"
)

// leaderWaitMargin is how long before the call's deadline a request
// waiting for a leader gives up, so that the caller gets the reason
// (Unavailable, no leader) rather than its own deadline.
const leaderWaitMargin = 500 * time.Millisecond

// The google.rpc.ErrorInfo of a request that found no leader (pvcli
// prints its hint on this reason), and the keys of its metadata: what the
// message says.
const (
	ErrorDomain    = "pivirt.pilab.hu"
	ReasonNoLeader = "NO_LEADER"
	// ReasonStoreUnavailable: in etcd mode, etcd did not answer for the
	// whole hold timeout.
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"

	metaVoters            = "voters"
	metaVotersReachable   = "voters_reachable"
	metaVotersUnreachable = "voters_unreachable"
	metaNoLeaderSince     = "no_leader_since"
)

// gaveUp is the error of a request that waited for a leader in vain for
// waited (cut: the call's deadline ended the wait before the hold timeout).
// Without a leader known here it says what this node knows of the cluster
// (leaderless); otherwise it names the last failure.
func (h *ClusterService) gaveUp(waited time.Duration, cut, direct bool, lastErr error) error {
	after := "after waiting " + h.cfg.HoldTimeout.String()
	if cut {
		after = fmt.Sprintf("after waiting %s (the call's deadline is near)", waited.Round(100*time.Millisecond))
	}
	if h.cfg.Direct {
		// The store (etcd) did not answer for the whole wait: said in an
		// ErrorInfo, so that a client asks again only while another whole
		// wait fits (as after NO_LEADER).
		ce := connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s: %v", after, lastErr))
		if !direct || !errors.Is(lastErr, store.ErrUnavailable) {
			return ce // waited for the schedules' leader (viaElected), not for etcd
		}
		if d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: ReasonStoreUnavailable, Domain: ErrorDomain}); err == nil {
			ce.AddDetail(d)
		}
		return ce
	}
	if id, _ := h.raft.Leader(); id == "" && errors.Is(lastErr, ErrNoLeader) {
		return h.leaderless(after)
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%w %s: %v", ErrNoLeader, after, lastErr))
}

// leaderless is the Unavailable error of a request that found no leader:
// since when this node has known none, how many voters of its Raft
// configuration it reaches of how many, how many a leader needs, and that
// stale reads still work. The error carries the same in a
// google.rpc.ErrorInfo (ReasonNoLeader).
func (h *ClusterService) leaderless(after string) error {
	var b strings.Builder
	b.WriteString(after)
	meta := map[string]string{}
	if since := h.raft.RaftStatus().NoLeaderSince; !since.IsZero() {
		fmt.Fprintf(&b, ": none since %s (%s ago)", since.UTC().Format(time.RFC3339), time.Since(since).Round(time.Second))
		meta[metaNoLeaderSince] = since.UTC().Format(time.RFC3339)
	} else {
		b.WriteString(": none known")
	}
	voters, reached, unreachable, err := h.reachableVoters()
	switch {
	case err != nil || voters == 0:
		b.WriteString("; this node knows no Raft configuration (the cluster has not bootstrapped, or this node has not joined it)")
	default:
		fmt.Fprintf(&b, "; %d of %d voters reachable from %s", reached, voters, h.cfg.NodeName)
		if len(unreachable) > 0 {
			fmt.Fprintf(&b, " (unreachable: %s)", strings.Join(unreachable, ", "))
		}
		fmt.Fprintf(&b, ", electing a leader needs %d", voters/2+1)
		meta[metaVoters] = strconv.Itoa(voters)
		meta[metaVotersReachable] = strconv.Itoa(reached)
		if len(unreachable) > 0 {
			meta[metaVotersUnreachable] = strings.Join(unreachable, ", ")
		}
	}
	b.WriteString("; reads with consistency stale are still served by every agent (pvcli --consistency stale)")
	ce := connect.NewError(connect.CodeUnavailable, fmt.Errorf("%w %s", ErrNoLeader, b.String()))
	if d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: ReasonNoLeader, Domain: ErrorDomain, Metadata: meta}); err == nil {
		ce.AddDetail(d)
	}
	return ce
}

// reachProbeTimeout bounds the question to each other voter whether it
// answers; it fits in leaderWaitMargin.
const reachProbeTimeout = 300 * time.Millisecond

// reachableVoters counts the voters of this node's Raft configuration and
// those it reaches: itself, and each other voter whose agent answers a
// status call on its internal port (at the address gossip knows) within
// reachProbeTimeout. Gossip alone is too slow for this: with most members
// gone, its failure detector takes tens of seconds to declare them failed.
// unreachable names the others, with their gossip state when it is not
// alive.
func (h *ClusterService) reachableVoters() (voters, reached int, unreachable []string, err error) {
	servers, err := h.admin.Servers(context.Background())
	if err != nil {
		return 0, 0, nil, err
	}
	type probe struct {
		name string
		ok   bool
	}
	var probes []*probe
	var wg sync.WaitGroup
	for _, s := range servers {
		if !s.Voter {
			continue
		}
		voters++
		if s.ID == h.cfg.NodeID {
			reached++
			continue
		}
		m, ok := h.members.MemberByID(s.ID)
		if !ok || m.Meta.InternalAddr == "" {
			unreachable = append(unreachable, s.ID+" (unknown to gossip)")
			continue
		}
		p := &probe{name: m.Name}
		if m.Status != cluster.StatusAlive {
			p.name += " (" + m.Status.String() + ")"
		}
		probes = append(probes, p)
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), reachProbeTimeout)
			defer cancel()
			_, err := h.peers.Status(ctx, m.Meta.InternalAddr)
			p.ok = err == nil
		})
	}
	wg.Wait()
	for _, p := range probes {
		if p.ok {
			reached++
		} else {
			unreachable = append(unreachable, p.name)
		}
	}
	slices.Sort(unreachable)
	return voters, reached, unreachable, nil
}

package agent

import (
	"context"
	"fmt"
	"slices"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// placement is the agent's side of mesh.Placement: the replicated
// placement catalog, the gossip ring's members and the connection pool.
type placement struct{ a *Agent }

func (p placement) Self() string { return p.a.cfg.NodeName }

// Routing implements mesh.Placement: routing by object, and the catalog
// behind it, are used once the cluster version allows them.
func (p placement) Routing() error {
	return p.a.requireFeature(fsm.FeaturePlacements, "routing a call to another node's backend")
}

func (p placement) Locate(kind, id string) (string, bool) {
	pl, err := p.a.fsm.State().Placement(kind, id)
	if err != nil || pl == nil {
		return "", false
	}
	return pl.GetNode(), true
}

// Nodes are the cluster's servers in the gossip ring, failed ones
// included (a node that is down is named as unreachable, not left out),
// retired ones not: a node that left (cluster leave, force-leave), or, in
// Raft mode, a failed one that is no longer a server of the Raft
// configuration (it left while this node missed its leave, or was removed),
// and whose objects the leader dropped from the catalog.
func (p placement) Nodes() []string {
	nodes := []string{p.Self()}
	var servers map[string]bool
	if !p.a.etcdMode() {
		ctx, cancel := context.WithTimeout(p.a.ctx, time.Second)
		list, err := p.a.raft.Servers(ctx)
		cancel()
		if err == nil {
			servers = make(map[string]bool, len(list))
			for _, s := range list {
				servers[s.ID] = true
			}
		}
	}
	if p.a.gossip != nil {
		for _, m := range p.a.gossip.Members() {
			if m.Status == cluster.StatusLeft || (m.Status == cluster.StatusFailed && servers != nil && !servers[m.Meta.ID]) {
				continue
			}
			if !servers[m.Meta.ID] && p.a.refusedMember(m) {
				continue // it could not prove the name it claims: not asked for the cluster's objects
			}
			if m.Meta.InternalAddr != "" && !slices.Contains(nodes, m.Name) {
				nodes = append(nodes, m.Name)
			}
		}
	}
	slices.Sort(nodes)
	return nodes
}

// refusedMember reports whether m claimed a name in gossip and could not
// prove it with its agent certificate; once its backoff ends it is asked
// again in the background (one proof at a time per member), and a list
// counts it again as soon as it proves the name.
func (a *Agent) refusedMember(m cluster.Member) bool {
	if a.admission == nil {
		return false
	}
	refused, due := a.admission.Refused(m)
	if refused && due {
		if _, busy := a.proving.LoadOrStore(m.Name, true); !busy && a.ctx.Err() == nil {
			// Not in a.wg, which start-time work alone joins: this ends
			// within peerAdmitTimeout, or with the agent's context.
			go func() {
				defer a.proving.Delete(m.Name)
				ctx, cancel := context.WithTimeout(a.ctx, peerAdmitTimeout)
				defer cancel()
				_ = a.admission.Admit(ctx, m)
			}()
		}
	}
	return refused
}

// memberProven reports whether m proved its identity to this node, or is
// a server of the Raft configuration (the leader admitted it on a proof):
// gossip forgets sooner the failed members that did neither.
func (a *Agent) memberProven(m cluster.Member) bool {
	if a.admission == nil || a.admission.Proven(m) {
		return true
	}
	if a.etcdMode() || a.raft.s == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(a.ctx, time.Second)
	defer cancel()
	list, err := a.raft.Servers(ctx)
	if err != nil {
		return true // unknown: kept for ForgetAfter
	}
	return slices.ContainsFunc(list, func(s cluster.RaftServer) bool { return s.ID == m.Meta.ID })
}

// peerAdmitTimeout bounds proving a member's identity before the first
// call routed to it.
const peerAdmitTimeout = 3 * time.Second

// Peer is the connection to node's agent: a member of the ring that is
// alive and, with TLS, proved that the name is its own (its agent
// certificate signs its gossip claim), so that callers' requests reach
// only that node.
func (p placement) Peer(node string) (grpc.ClientConnInterface, error) {
	var (
		m     cluster.Member
		found bool
	)
	if p.a.gossip != nil {
		for _, c := range p.a.gossip.Members() {
			if c.Name == node {
				m, found = c, true
				break
			}
		}
	}
	switch {
	case !found:
		return nil, fmt.Errorf("node %s is not a member of the cluster", node)
	case m.Status != cluster.StatusAlive:
		return nil, fmt.Errorf("node %s is %s since %s", node, m.Status, m.Since.UTC().Format(time.RFC3339))
	case m.Meta.InternalAddr == "":
		return nil, fmt.Errorf("node %s advertises no internal address", node)
	}
	if p.a.admission != nil && !p.a.admission.Proven(m) {
		ctx, cancel := context.WithTimeout(p.a.ctx, peerAdmitTimeout)
		defer cancel()
		if err := p.a.admission.Admit(ctx, m); err != nil {
			return nil, fmt.Errorf("node %s has not proven its identity: %w", node, err)
		}
	}
	return p.a.pool.Conn(m.Meta.InternalAddr), nil
}

// vmExists checks, with GetVM where the VM lives, that a schedule's VM
// exists. Without a route for the VM API there is nothing to ask: the
// schedule's runs will say so.
func (a *Agent) vmExists(ctx context.Context, id string) error {
	const method = "/pivirt.vm.v1.VMService/GetVM"
	if a.proxy.Route(method) == nil {
		return nil
	}
	_, err := a.proxy.Invoke(ctx, method, &vmv1.GetVMRequest{Id: id}, &vmv1.GetVMResponse{})
	if err != nil {
		st := status.Convert(err)
		return connect.NewError(connect.Code(st.Code()), fmt.Errorf("checking that vm %s exists: %s", id, st.Message()))
	}
	return nil
}

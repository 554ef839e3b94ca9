package fsm

import (
	"fmt"
	"slices"

	"google.golang.org/protobuf/proto"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// MaxPlacementsPerCommand bounds the upserts and deletes of one
// set_placements command together. Like the other limits it is part of the
// replicated semantics.
const MaxPlacementsPerCommand = 10000

// placementKinds are the kinds of the placement catalog: the RBAC
// resources of the objects node-scoped backends hold.
var placementKinds = []string{"virtualmachines", "volumes", "networks"}

// PlacementKinds returns the kinds a placement may have.
func PlacementKinds() []string { return slices.Clone(placementKinds) }

// internKind returns placementKinds' own copy of kind, so that the catalog's
// records share three strings instead of holding one each.
func internKind(kind string) string {
	if i := slices.Index(placementKinds, kind); i >= 0 {
		return placementKinds[i]
	}
	return kind
}

// placementKey is the map key of a (kind, id) pair.
func placementKey(kind, id string) string { return kind + "\x00" + id }

// applySetPlacements records what one node's backends hold. Each upsert
// places (kind, id) on node, taking it from whichever node held it before
// (a migration); each delete removes (kind, id) if node holds it; for each
// kind of full_kinds, the upserts are the node's whole listing of that
// kind, so its other entries of that kind are removed. Only what changes
// is written: a listing that matches the catalog writes nothing and moves
// no index.
func (f *FSM) applySetPlacements(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetSetPlacements()
	const p = "set_placements"
	node := op.GetNode()
	if err := checkID(p+".node", node); err != nil {
		return nil, err
	}
	if n := len(op.GetUpsert()) + len(op.GetDelete()); n > MaxPlacementsPerCommand {
		return nil, invalidf("%s: %d upserts and deletes, at most %d allowed", p, n, MaxPlacementsPerCommand)
	}
	for i, k := range op.GetFullKinds() {
		if !slices.Contains(placementKinds, k) {
			return nil, invalidf("%s.full_kinds[%d]: %q is not a placement kind (%v)", p, i, k, placementKinds)
		}
		if slices.Contains(op.GetFullKinds()[:i], k) {
			return nil, invalidf("%s.full_kinds[%d]: %q is listed twice", p, i, k)
		}
	}
	// An object both upserted and deleted has no meaning to pick; one
	// listed twice in the same list counts once. The value tells an
	// upsert.
	listed := make(map[string]bool, len(op.GetUpsert())+len(op.GetDelete()))
	check := func(field string, list []*fsmv1.Placement, upsert bool) ([]*fsmv1.Placement, error) {
		out := list
		for i, e := range list {
			if !slices.Contains(placementKinds, e.GetKind()) {
				return nil, invalidf("%s.%s[%d].kind: %q is not a placement kind (%v)", p, field, i, e.GetKind(), placementKinds)
			}
			if checkID("id", e.GetId()) != nil {
				return nil, checkID(fmt.Sprintf("%s.%s[%d].id", p, field, i), e.GetId())
			}
			k := placementKey(e.GetKind(), e.GetId())
			if up, dup := listed[k]; dup {
				if up != upsert {
					return nil, invalidf("%s.%s[%d]: %s %q is both upserted and deleted", p, field, i, e.GetKind(), e.GetId())
				}
				if len(out) == len(list) {
					// The first repeat: from here on, a list without them.
					out = slices.Clone(list[:i])
				}
				continue
			}
			listed[k] = upsert
			if len(out) != len(list) {
				out = append(out, e)
			}
		}
		return out, nil
	}
	upserts, err := check("upsert", op.GetUpsert(), true)
	if err != nil {
		return nil, err
	}
	deletes, err := check("delete", op.GetDelete(), false)
	if err != nil {
		return nil, err
	}

	// Work out the whole effect before the first write.
	var (
		dels []*fsmv1.Placement
		puts []*fsmv1.Placement
	)
	if len(op.GetFullKinds()) > 0 {
		held, err := scan[*fsmv1.Placement](t, TablePlacements, indexNode, node)
		if err != nil {
			return nil, err
		}
		for _, e := range held {
			if !slices.Contains(op.GetFullKinds(), e.GetKind()) {
				continue
			}
			if !listed[placementKey(e.GetKind(), e.GetId())] {
				dels = append(dels, e)
			}
		}
	}
	for _, e := range upserts {
		old, err := lookup[*fsmv1.Placement](t, TablePlacements, e.GetKind(), e.GetId())
		if err != nil {
			return nil, err
		}
		if old != nil && old.GetNode() == node {
			continue
		}
		puts = append(puts, &fsmv1.Placement{Kind: internKind(e.GetKind()), Id: e.GetId(), Node: node})
	}
	for _, e := range deletes {
		old, err := lookup[*fsmv1.Placement](t, TablePlacements, e.GetKind(), e.GetId())
		if err != nil {
			return nil, err
		}
		if old == nil || old.GetNode() != node {
			// Not held by this node: gone already, or moved away.
			continue
		}
		if slices.Contains(op.GetFullKinds(), old.GetKind()) {
			// The full listing removes it already (it is not upserted).
			continue
		}
		dels = append(dels, old)
	}

	for _, e := range dels {
		if err := t.delete(TablePlacements, e); err != nil {
			return nil, err
		}
	}
	for _, e := range puts {
		if err := t.insert(TablePlacements, e); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

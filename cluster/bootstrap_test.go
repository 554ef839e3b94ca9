package cluster

import (
	"context"
	"errors"
	"strings"
	"testing"

	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

type fakePeers map[string]*nodev1.StatusResponse

func (p fakePeers) Status(_ context.Context, addr string) (*nodev1.StatusResponse, error) {
	st, ok := p[addr]
	if !ok {
		return nil, errors.New("connection refused")
	}
	return st, nil
}

func expectMember(id string, expect int) Member {
	return Member{Name: "n-" + id, Status: StatusAlive, Meta: NodeMeta{ID: id, Role: RoleServer, RaftAddr: "raft-" + id, InternalAddr: "int-" + id, BootstrapExpect: expect}}
}

func TestBootstrapCandidates(t *testing.T) {
	empty := &nodev1.StatusResponse{BootstrapCandidates: []string{"a", "b", "c"}}
	other := &nodev1.StatusResponse{BootstrapCandidates: []string{"a", "b", "d"}}
	for _, tc := range []struct {
		name       string
		members    []Member
		peers      fakePeers
		wantReason string
		wantErr    error
		wantVoters []bool
	}{
		{
			name:       "waits for the expected count",
			members:    []Member{expectMember("a", 3), expectMember("b", 3)},
			wantReason: "2 of 3 expected servers",
		},
		{
			name:       "waits when a server expects another count",
			members:    []Member{expectMember("a", 3), expectMember("b", 5), expectMember("c", 3)},
			wantReason: "expects 5 servers, this one 3",
		},
		{
			name:       "waits while a peer cannot be asked",
			members:    []Member{expectMember("a", 3), expectMember("b", 3), expectMember("c", 3)},
			peers:      fakePeers{"int-b": empty},
			wantReason: "cannot ask n-c",
		},
		{
			name:    "skips when a peer already has raft state",
			members: []Member{expectMember("a", 3), expectMember("b", 3), expectMember("c", 3)},
			peers:   fakePeers{"int-b": empty, "int-c": {HasState: true}},
			wantErr: ErrBootstrapSkipped,
		},
		{
			name:       "waits while more servers than expected are seen",
			members:    []Member{expectMember("a", 3), expectMember("b", 3), expectMember("c", 3), expectMember("d", 3)},
			peers:      fakePeers{"int-b": empty, "int-c": empty, "int-d": empty},
			wantReason: "more than expected",
		},
		{
			name:       "waits while a candidate sees another candidate set",
			members:    []Member{expectMember("a", 3), expectMember("b", 3), expectMember("c", 3)},
			peers:      fakePeers{"int-b": other, "int-c": empty},
			wantReason: "sees other bootstrap candidates",
		},
		{
			name:    "skips when a server without bootstrap_expect already has state",
			members: []Member{expectMember("a", 3), expectMember("b", 3), expectMember("c", 3), expectMember("j", 0)},
			peers:   fakePeers{"int-b": empty, "int-c": empty, "int-j": {HasState: true}},
			wantErr: ErrBootstrapSkipped,
		},
		{
			name:       "bootstraps every server, voters up to the target",
			members:    []Member{expectMember("c", 3), expectMember("a", 3), expectMember("b", 3), expectMember("d", 0)},
			peers:      fakePeers{"int-b": empty, "int-c": empty},
			wantVoters: []bool{true, true, true},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := BootstrapConfig{SelfID: "a", Expect: 3, Voters: 3}
			view := &BootstrapView{}
			servers, reason, err := bootstrapCandidates(context.Background(), cfg, fakeMembers(tc.members), tc.peers, view)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("err = %v, want %v", err, tc.wantErr)
			}
			if tc.wantReason != "" && !strings.Contains(reason, tc.wantReason) {
				t.Fatalf("reason = %q, want it to contain %q", reason, tc.wantReason)
			}
			if tc.wantVoters == nil {
				if servers != nil {
					t.Fatalf("bootstrapped %v, want to wait", servers)
				}
				return
			}
			if len(servers) != len(tc.wantVoters) {
				t.Fatalf("got %d servers, want %d: %v", len(servers), len(tc.wantVoters), servers)
			}
			for i, s := range servers {
				if s.Voter != tc.wantVoters[i] || s.Address != "raft-"+s.ID {
					t.Errorf("server %d = %+v", i, s)
				}
				if i > 0 && servers[i-1].ID >= s.ID {
					t.Errorf("servers not sorted by id: %v", servers)
				}
			}
		})
	}
}

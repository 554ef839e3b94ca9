package fsm

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// historyRevisions returns the revisions of a key's history, newest first.
func historyRevisions(t *testing.T, h *harness, key string) []uint64 {
	t.Helper()
	hist, err := h.f.State().ConfigHistory(key)
	if err != nil {
		t.Fatalf("ConfigHistory(%q): %v", key, err)
	}
	var revs []uint64
	for _, e := range hist {
		revs = append(revs, e.GetRevision())
	}
	return revs
}

func TestSetConfig(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name: "new key",
			cmd:  setConfig("log.level", "debug"),
			check: func(t *testing.T, h *harness, res *Result) {
				want := &clusterv1.ConfigEntry{Key: "log.level", Value: "debug", Revision: 1, CreateIndex: 1, UpdatedAt: at(1)}
				got, err := h.f.State().ConfigEntry("log.level")
				if err != nil || !proto.Equal(got, want) {
					t.Errorf("ConfigEntry = %v, %v; want %v", got, err, want)
				}
				if !proto.Equal(res.Value, want) {
					t.Errorf("Result.Value = %v, want %v", res.Value, want)
				}
				if revs := historyRevisions(t, h, "log.level"); !slices.Equal(revs, []uint64{1}) {
					t.Errorf("history revisions = %v, want [1]", revs)
				}
			},
		},
		{
			name:  "update keeps create_index and appends history",
			setup: []*fsmv1.Command{setConfig("log.level", "info"), setConfig("other", "x")},
			cmd:   setConfig("log.level", "debug"),
			check: func(t *testing.T, h *harness, res *Result) {
				got, _ := h.f.State().ConfigEntry("log.level")
				if got.GetRevision() != 3 || got.GetCreateIndex() != 1 || got.GetValue() != "debug" || !proto.Equal(got.GetUpdatedAt(), at(3)) {
					t.Errorf("ConfigEntry = %v, want revision 3, create 1, value debug, updated at(3)", got)
				}
				if revs := historyRevisions(t, h, "log.level"); !slices.Equal(revs, []uint64{3, 1}) {
					t.Errorf("history revisions = %v, want [3 1]", revs)
				}
			},
		},
		{name: "cas 0 on a new key", cmd: setConfigCAS("k", "v", 0)},
		{name: "cas matching revision", setup: []*fsmv1.Command{setConfig("k", "v1")}, cmd: setConfigCAS("k", "v2", 1)},
		{name: "cas 0 on an existing key", setup: []*fsmv1.Command{setConfig("k", "v1")}, cmd: setConfigCAS("k", "v2", 0), wantErr: ErrCASConflict},
		{name: "cas stale revision", setup: []*fsmv1.Command{setConfig("k", "v1"), setConfig("k", "v2")}, cmd: setConfigCAS("k", "v3", 1), wantErr: ErrCASConflict},
		{name: "cas on a missing key", cmd: setConfigCAS("k", "v", 5), wantErr: ErrCASConflict},
		{name: "key of 256 characters", cmd: setConfig(strings.Repeat("é", MaxConfigKeyLength), "v")},
		{name: "value of 512 KiB", cmd: setConfig("k", strings.Repeat("x", MaxConfigValueSize))},
		{name: "empty value", cmd: setConfig("k", "")},
		{name: "missing key", cmd: setConfig("", "v"), wantErr: ErrInvalidCommand, check: wantField("set_config.key")},
		{name: "key with whitespace", cmd: setConfig("log level", "v"), wantErr: ErrInvalidCommand, check: wantField("set_config.key")},
		{name: "key with tab", cmd: setConfig("log\tlevel", "v"), wantErr: ErrInvalidCommand, check: wantField("set_config.key")},
		{name: "key too long", cmd: setConfig(strings.Repeat("k", MaxConfigKeyLength+1), "v"), wantErr: ErrInvalidCommand, check: wantField("set_config.key")},
		{name: "value too large", cmd: setConfig("k", strings.Repeat("x", MaxConfigValueSize+1)), wantErr: ErrInvalidCommand, check: wantField("set_config.value")},
	})
}

func TestConfigHistoryLimit(t *testing.T) {
	h := newHarness(t, func(c *Config) { c.ConfigHistoryLimit = 3 })
	for i := range 5 {
		h.mustApply(setConfig("k", strings.Repeat("v", i)))
		h.mustApply(setConfig("other", "x"))
	}
	if revs := historyRevisions(t, h, "k"); !slices.Equal(revs, []uint64{9, 7, 5}) {
		t.Errorf("history of k = %v, want [9 7 5]", revs)
	}
	if revs := historyRevisions(t, h, "other"); !slices.Equal(revs, []uint64{10, 8, 6}) {
		t.Errorf("history of other = %v, want [10 8 6]", revs)
	}
	hist, _ := h.f.State().ConfigHistory("k")
	cur, _ := h.f.State().ConfigEntry("k")
	if !proto.Equal(hist[0], cur) {
		t.Errorf("newest history entry %v, current entry %v: want equal", hist[0], cur)
	}
}

func TestDeleteConfig(t *testing.T) {
	runApplyCases(t, []applyCase{
		{
			name:  "existing key",
			setup: []*fsmv1.Command{setConfig("k", "v1"), setConfig("k", "v2"), setConfig("other", "x")},
			cmd:   deleteConfig("k"),
			check: func(t *testing.T, h *harness, res *Result) {
				st := h.f.State()
				if _, err := st.ConfigEntry("k"); !errors.Is(err, ErrNotFound) {
					t.Errorf("ConfigEntry after delete: %v, want ErrNotFound", err)
				}
				if _, err := st.ConfigHistory("k"); !errors.Is(err, ErrNotFound) {
					t.Errorf("ConfigHistory after delete: %v, want ErrNotFound", err)
				}
				if revs := historyRevisions(t, h, "other"); !slices.Equal(revs, []uint64{3}) {
					t.Errorf("history of other = %v, want [3]", revs)
				}
				if st.Index(TableConfig) != 4 || st.Index(TableConfigHistory) != 4 {
					t.Errorf("indexes config %d history %d, want 4 4", st.Index(TableConfig), st.Index(TableConfigHistory))
				}
			},
		},
		{name: "cas matching", setup: []*fsmv1.Command{setConfig("k", "v1")}, cmd: deleteConfigCAS("k", 1)},
		{name: "cas mismatch", setup: []*fsmv1.Command{setConfig("k", "v1"), setConfig("k", "v2")}, cmd: deleteConfigCAS("k", 1), wantErr: ErrCASConflict},
		{name: "cas 0 on an existing key", setup: []*fsmv1.Command{setConfig("k", "v1")}, cmd: deleteConfigCAS("k", 0), wantErr: ErrCASConflict},
		{name: "absent", setup: []*fsmv1.Command{setConfig("k", "v1")}, cmd: deleteConfig("x"), wantErr: ErrNotFound},
		{name: "missing key", cmd: deleteConfig(""), wantErr: ErrInvalidCommand, check: wantField("delete_config.key")},
	})
}

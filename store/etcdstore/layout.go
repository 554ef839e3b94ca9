package etcdstore

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"path"
	"strconv"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// layout maps the state's tables to etcd keys (DESIGN.md, "Layout in etcd").
// The services live under the configured prefix (/pivirt/services); the
// other tables beside it, under the prefix's parent (/pivirt).
type layout struct {
	root     string // "/pivirt"; "" when the prefix is a top-level name
	services string // "/pivirt/services"
}

func newLayout(prefix string) layout {
	prefix = strings.TrimRight(prefix, "/")
	root := path.Dir(prefix)
	if root == "/" || root == "." {
		root = ""
	}
	return layout{root: root, services: prefix}
}

// Subtrees of the root, one per table that is not under the services
// prefix.
const (
	dirConfig   = "/config/"
	dirHistory  = "/config_history/"
	dirSched    = "/schedules/"
	dirRuns     = "/schedule_runs/"
	dirPlace    = "/placements/"
	dirDedupe   = "/dedupe/"
	dirElection = "/leader"
	dirMeta     = "/meta/"
	keyCA       = "/ca"
	// keyVersion is the data-format version of the keys: the cluster
	// version (absent: 0.0, the agents that predate it).
	keyVersion = "/cluster_version"
)

// watchPrefix covers every key of the layout.
func (l layout) watchPrefix() string { return l.root + "/" }

func (l layout) election() string { return l.root + dirElection }

// grouped tables keep every record sharing the leading key field in one etcd
// key (a JSON list): the versions of a config key, the runs of a schedule. A
// write then touches a few keys, within etcd's limit of operations per
// transaction (128 by default), however many runs a catch-up records.
func grouped(table string) bool {
	return table == fsm.TableConfigHistory || table == fsm.TableScheduleRuns
}

// seg escapes one path segment: "/" and "%" (and whatever else is not
// safe in a path) are percent-encoded.
func seg(s string) string { return url.PathEscape(s) }

// key returns the etcd key holding rec, a record of table.
func (l layout) key(table string, rec proto.Message) (string, error) {
	switch r := rec.(type) {
	case *clusterv1.ServiceInstance:
		if table == fsm.TableServices {
			return l.services + "/" + seg(r.GetService()) + "/" + seg(r.GetInstanceId()), nil
		}
	case *clusterv1.ConfigEntry:
		switch table {
		case fsm.TableConfig:
			return l.root + dirConfig + seg(r.GetKey()), nil
		case fsm.TableConfigHistory:
			return l.root + dirHistory + seg(r.GetKey()), nil
		}
	case *schedulev1.Schedule:
		if table == fsm.TableSchedules {
			return l.root + dirSched + seg(r.GetId()), nil
		}
	case *schedulev1.Run:
		if table == fsm.TableScheduleRuns {
			return l.root + dirRuns + seg(r.GetScheduleId()), nil
		}
	case *fsmv1.ClusterCA:
		if table == fsm.TableCA {
			return l.root + keyCA, nil
		}
	case *fsmv1.ClusterVersion:
		if table == fsm.TableClusterVersion {
			return l.root + keyVersion, nil
		}
	case *fsmv1.Placement:
		if table == fsm.TablePlacements {
			return l.root + dirPlace + seg(r.GetKind()) + "/" + seg(r.GetId()), nil
		}
	case *fsmv1.DedupeRecord:
		if table == fsm.TableDedupe {
			return l.root + dirDedupe + seg(r.GetClientId()) + "/" + strconv.FormatUint(r.GetSequence(), 10), nil
		}
	}
	return "", fmt.Errorf("no etcd key for a %T in table %s", rec, table)
}

// table classifies an etcd key: the table whose records it holds, or ""
// for a key of the layout that holds none (election, meta) or a key
// outside it.
func (l layout) table(key string) string {
	switch {
	case strings.HasPrefix(key, l.services+"/"):
		return fsm.TableServices
	case !strings.HasPrefix(key, l.root+"/"):
		return ""
	}
	rest := key[len(l.root):]
	switch {
	case strings.HasPrefix(rest, dirConfig):
		return fsm.TableConfig
	case strings.HasPrefix(rest, dirHistory):
		return fsm.TableConfigHistory
	case strings.HasPrefix(rest, dirSched):
		return fsm.TableSchedules
	case strings.HasPrefix(rest, dirRuns):
		return fsm.TableScheduleRuns
	case strings.HasPrefix(rest, dirPlace):
		return fsm.TablePlacements
	case strings.HasPrefix(rest, dirDedupe):
		return fsm.TableDedupe
	case rest == keyCA:
		return fsm.TableCA
	case rest == keyVersion:
		return fsm.TableClusterVersion
	}
	return ""
}

// Values are protojson with the proto field names, so that `etcdctl get
// /pivirt/services --prefix` reads as the API does. A grouped key holds a
// JSON list. Index fields set by the write that stores a record are left
// out (they are the key's mod_revision, which decode puts back).
var (
	marshalOpts   = protojson.MarshalOptions{UseProtoNames: true}
	unmarshalOpts = protojson.UnmarshalOptions{DiscardUnknown: true}
)

// encode returns the value of an etcd key holding recs (one record unless
// the table is grouped). Index fields equal to fsm.PendingIndex are left
// out.
func encode(table string, recs []proto.Message) ([]byte, error) {
	if !grouped(table) {
		if len(recs) != 1 {
			return nil, fmt.Errorf("encode %s: %d records for one key", table, len(recs))
		}
		return encodeRecord(table, recs[0])
	}
	parts := make([][]byte, len(recs))
	for i, rec := range recs {
		b, err := encodeRecord(table, rec)
		if err != nil {
			return nil, err
		}
		parts[i] = b
	}
	return joinList(parts), nil
}

// encodeRecord is the JSON of one record.
func encodeRecord(table string, rec proto.Message) ([]byte, error) {
	c := proto.Clone(rec)
	fsm.SetIndexFields(c, fsm.PendingIndex, 0)
	b, err := marshalOpts.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("encode %s record: %w", table, err)
	}
	// protojson may add spaces at random; compact keeps values stable.
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return nil, fmt.Errorf("encode %s record: %w", table, err)
	}
	return buf.Bytes(), nil
}

// joinList is the JSON list of encoded records.
func joinList(parts [][]byte) []byte {
	n := 2
	for _, p := range parts {
		n += len(p) + 1
	}
	out := make([]byte, 0, n)
	out = append(out, '[')
	for i, p := range parts {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, p...)
	}
	return append(out, ']')
}

// maxGroupBytes bounds the value of a grouped key: with the current
// config value beside it (512 KiB at most) a write stays within etcd's
// default --max-request-bytes of 1.5 MiB. The oldest records of a longer
// list are not kept (fitGroup).
const maxGroupBytes = 768 << 10

// fitGroup encodes the records of a grouped key, oldest first, leaving out
// the oldest ones while the value would exceed maxGroupBytes (the newest
// is always kept). It returns the value and how many were left out.
func fitGroup(table string, recs []proto.Message) ([]byte, int, error) {
	parts := make([][]byte, len(recs))
	size := 2
	for i, rec := range recs {
		b, err := encodeRecord(table, rec)
		if err != nil {
			return nil, 0, err
		}
		parts[i] = b
		size += len(b) + 1
	}
	drop := 0
	for size > maxGroupBytes && drop < len(parts)-1 {
		size -= len(parts[drop]) + 1
		drop++
	}
	return joinList(parts[drop:]), drop, nil
}

// decode parses the value of a key of table written at modRev; the index
// fields left out by encode become modRev.
func decode(table string, value []byte, modRev int64) ([]proto.Message, error) {
	one := func(b []byte) (proto.Message, error) {
		rec := fsm.NewRecord(table)
		if rec == nil {
			return nil, fmt.Errorf("decode: unknown table %q", table)
		}
		if err := unmarshalOpts.Unmarshal(b, rec); err != nil {
			return nil, fmt.Errorf("decode %s record: %w", table, err)
		}
		fsm.SetIndexFields(rec, 0, uint64(modRev))
		return rec, nil
	}
	if !grouped(table) {
		rec, err := one(value)
		if err != nil {
			return nil, err
		}
		return []proto.Message{rec}, nil
	}
	var raw []json.RawMessage
	if err := json.Unmarshal(value, &raw); err != nil {
		return nil, fmt.Errorf("decode %s list: %w", table, err)
	}
	out := make([]proto.Message, 0, len(raw))
	for _, b := range raw {
		rec, err := one(b)
		if err != nil {
			return nil, err
		}
		out = append(out, rec)
	}
	return out, nil
}

package gateway

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// TestWritten: the answer to a write carries the record the write wrote,
// for a repeat too; a repeat of a write an older agent recorded (no value
// kept) carries the current record only while it is that write's own.
func TestWritten(t *testing.T) {
	mine := &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Address: "10.0.0.1", ModifyIndex: 7}
	theirs := &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Address: "10.0.0.2", ModifyIndex: 9}
	index := (*clusterv1.ServiceInstance).GetModifyIndex
	current := func(in *clusterv1.ServiceInstance, err error) func() (*clusterv1.ServiceInstance, error) {
		return func() (*clusterv1.ServiceInstance, error) { return in, err }
	}
	tests := []struct {
		name string
		res  *fsm.Result
		cur  func() (*clusterv1.ServiceInstance, error)
		want *clusterv1.ServiceInstance
	}{
		{"the write", &fsm.Result{Index: 7, Value: mine}, current(theirs, nil), mine},
		{"a repeat keeps the write's record", &fsm.Result{Index: 7, Value: mine, Duplicate: true}, current(theirs, nil), mine},
		{"an older record, still the write's", &fsm.Result{Index: 7, Duplicate: true}, current(mine, nil), mine},
		{"an older record, replaced since", &fsm.Result{Index: 7, Duplicate: true}, current(theirs, nil), nil},
		{"an older record, deleted since", &fsm.Result{Index: 7, Duplicate: true}, current(nil, fsm.ErrNotFound), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := written(tt.res, tt.cur, index)
			if !proto.Equal(got, tt.want) {
				t.Errorf("written = %v, want %v", got, tt.want)
			}
		})
	}
}

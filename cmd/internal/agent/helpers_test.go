package agent_test

import (
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
)

func durationProto(d time.Duration) *durationpb.Duration { return durationpb.New(d) }

package sim

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
)

// object is what the simulator stores: a VM, a volume or a network.
type object interface {
	proto.Message
	GetId() string
	GetName() string
	GetMetadata() *apiv1.ObjectMeta
}

const (
	// defaultPageSize and maxPageSize bound list pages.
	defaultPageSize = 100
	maxPageSize     = 1000
)

var metaBucket = []byte("meta")

// table stores one kind of object in a bbolt bucket, keyed by ID, as
// protobuf.
type table[T object] struct {
	db     *bolt.DB
	bucket []byte
	// kind names the object in errors ("vm"); it prefixes new IDs.
	kind string
	// mutable lists the fields an update may change; "labels" is
	// metadata.labels.
	mutable []string
	// validate checks a whole object before it is stored.
	validate func(T) error
	newT     func() T
	now      func() time.Time
}

func (t *table[T]) init() error {
	return t.db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(metaBucket); err != nil {
			return err
		}
		_, err := tx.CreateBucketIfNotExists(t.bucket)
		return err
	})
}

func (t *table[T]) decode(b []byte) (T, error) {
	obj := t.newT()
	if err := proto.Unmarshal(b, obj); err != nil {
		return obj, status.Errorf(codes.DataLoss, "%s: stored record: %v", t.kind, err)
	}
	return obj, nil
}

// notFound is NotFound with a ResourceInfo detail, as real backends send.
func (t *table[T]) notFound(id string) error {
	st := status.Newf(codes.NotFound, "%s %q not found", t.kind, id)
	if d, err := st.WithDetails(&errdetails.ResourceInfo{ResourceType: t.kind, ResourceName: id, Description: "no such " + t.kind}); err == nil {
		st = d
	}
	return st.Err()
}

// revision returns the next store-wide revision.
func revision(tx *bolt.Tx) (uint64, error) {
	return tx.Bucket(metaBucket).NextSequence()
}

func (t *table[T]) get(id string) (T, error) {
	var obj T
	if id == "" {
		return obj, status.Errorf(codes.InvalidArgument, "id: required")
	}
	err := t.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(t.bucket).Get([]byte(id))
		if b == nil {
			return t.notFound(id)
		}
		var err error
		obj, err = t.decode(b)
		return err
	})
	return obj, err
}

func (t *table[T]) put(tx *bolt.Tx, obj T) error {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(obj)
	if err != nil {
		return status.Errorf(codes.Internal, "%s: encode: %v", t.kind, err)
	}
	return tx.Bucket(t.bucket).Put([]byte(obj.GetId()), b)
}

// IdentityHeader names the principal an agent calls on behalf of
// (percent-encoded); an object created without an owner belongs to it
// (pivirtd's behaviour).
const IdentityHeader = "x-pivirt-identity"

// create stores a new object with a new ID, times and revision. The
// caller's id and metadata times are ignored; owner and labels are kept,
// and an object without an owner gets the calling principal's identity.
func (t *table[T]) create(ctx context.Context, req T) (T, error) {
	var zero T
	if !req.ProtoReflect().IsValid() {
		return zero, status.Errorf(codes.InvalidArgument, "%s: required", t.kind)
	}
	obj := proto.Clone(req).(T)
	m := obj.ProtoReflect()
	m.Set(m.Descriptor().Fields().ByName("id"), protoreflect.ValueOfString(t.kind+"-"+uuid.NewString()[:8]))
	meta := &apiv1.ObjectMeta{Owner: req.GetMetadata().GetOwner(), Labels: req.GetMetadata().GetLabels()}
	if meta.Owner == "" {
		if v := metadata.ValueFromIncomingContext(ctx, IdentityHeader); len(v) > 0 {
			if id, err := url.PathUnescape(v[0]); err == nil {
				meta.Owner = id
			}
		}
	}
	m.Set(m.Descriptor().Fields().ByName("metadata"), protoreflect.ValueOfMessage(meta.ProtoReflect()))
	if err := t.validate(obj); err != nil {
		return zero, err
	}
	err := t.db.Update(func(tx *bolt.Tx) error {
		if err := t.nameFree(tx, obj.GetName()); err != nil {
			return err
		}
		rev, err := revision(tx)
		if err != nil {
			return err
		}
		now := timestamppb.New(t.now())
		meta.CreateTime, meta.UpdateTime, meta.Revision = now, now, rev
		return t.put(tx, obj)
	})
	if err != nil {
		return zero, err
	}
	return obj, nil
}

// nameFree fails with AlreadyExists when an object has the name.
func (t *table[T]) nameFree(tx *bolt.Tx, name string) error {
	dup, err := t.byName(tx, name)
	if err == nil && dup != "" {
		err = status.Errorf(codes.AlreadyExists, "%s named %q already exists (%s)", t.kind, name, dup)
	}
	return err
}

// byName returns the ID of the object with the given name, "" if none.
func (t *table[T]) byName(tx *bolt.Tx, name string) (string, error) {
	c := tx.Bucket(t.bucket).Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		obj, err := t.decode(v)
		if err != nil {
			return "", err
		}
		if obj.GetName() == name {
			return obj.GetId(), nil
		}
	}
	return "", nil
}

// update changes the object id in one transaction: mutate gets the stored
// object and changes it; the result is validated and stored with a new
// revision. expected, when set, must equal the stored revision.
func (t *table[T]) update(id string, expected *uint64, mutate func(T) error) (T, error) {
	var out T
	if id == "" {
		return out, status.Errorf(codes.InvalidArgument, "%s.id: required", t.kind)
	}
	// db.Batch commits concurrent updates together. It runs the function
	// again (alone) when another of the batch fails, so the function only
	// reads the transaction and what it was given: it may run twice.
	err := t.db.Batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(t.bucket).Get([]byte(id))
		if b == nil {
			return t.notFound(id)
		}
		obj, err := t.decode(b)
		if err != nil {
			return err
		}
		if expected != nil && *expected != obj.GetMetadata().GetRevision() {
			return status.Errorf(codes.Aborted, "%s %q: expected_revision %d, current revision %d", t.kind, id, *expected, obj.GetMetadata().GetRevision())
		}
		oldName := obj.GetName()
		if err := mutate(obj); err != nil {
			return err
		}
		if err := t.validate(obj); err != nil {
			return err
		}
		if obj.GetName() != oldName {
			if err := t.nameFree(tx, obj.GetName()); err != nil {
				return err
			}
		}
		rev, err := revision(tx)
		if err != nil {
			return err
		}
		obj.GetMetadata().Revision = rev
		obj.GetMetadata().UpdateTime = timestamppb.New(t.now())
		out = obj
		return t.put(tx, obj)
	})
	return out, err
}

// patch applies the fields of mask (every mutable field when empty) from
// src to dst.
func (t *table[T]) patch(dst, src T, mask *fieldmaskpb.FieldMask) error {
	paths := mask.GetPaths()
	if len(paths) == 0 {
		paths = t.mutable
	}
	for _, p := range paths {
		if !slices.Contains(t.mutable, p) {
			return status.Errorf(codes.InvalidArgument, "update_mask: %q cannot be updated (updatable: %s)", p, strings.Join(t.mutable, ", "))
		}
		if p == "labels" {
			dst.GetMetadata().Labels = src.GetMetadata().GetLabels()
			continue
		}
		d, s := dst.ProtoReflect(), src.ProtoReflect()
		fd := d.Descriptor().Fields().ByName(protoreflect.Name(p))
		if s.Has(fd) {
			d.Set(fd, s.Get(fd))
		} else {
			d.Clear(fd)
		}
	}
	return nil
}

func (t *table[T]) delete(id string) (T, error) {
	var out T
	if id == "" {
		return out, status.Errorf(codes.InvalidArgument, "id: required")
	}
	err := t.db.Update(func(tx *bolt.Tx) error {
		bk := tx.Bucket(t.bucket)
		b := bk.Get([]byte(id))
		if b == nil {
			return t.notFound(id)
		}
		var err error
		if out, err = t.decode(b); err != nil {
			return err
		}
		return bk.Delete([]byte(id))
	})
	return out, err
}

// list returns a page of objects in ID order, of one owner when owner is
// set. The page token is the last ID of the previous page.
func (t *table[T]) list(pageSize int32, token, owner string) ([]T, string, error) {
	switch {
	case pageSize < 0 || pageSize > maxPageSize:
		return nil, "", status.Errorf(codes.InvalidArgument, "page_size: %d, want 0 to %d", pageSize, maxPageSize)
	case pageSize == 0:
		pageSize = defaultPageSize
	}
	after, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil {
		return nil, "", status.Errorf(codes.InvalidArgument, "page_token: not a token of this list")
	}
	var out []T
	var next string
	err = t.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(t.bucket).Cursor()
		k, v := c.First()
		if len(after) > 0 {
			k, v = c.Seek(after)
			if k != nil && string(k) == string(after) {
				k, v = c.Next()
			}
		}
		for ; k != nil; k, v = c.Next() {
			obj, err := t.decode(v)
			if err != nil {
				return err
			}
			if owner != "" && obj.GetMetadata().GetOwner() != owner {
				continue
			}
			if len(out) == int(pageSize) {
				next = base64.RawURLEncoding.EncodeToString([]byte(out[len(out)-1].GetId()))
				return nil
			}
			out = append(out, obj)
		}
		return nil
	})
	return out, next, err
}

// checkName validates an object name: 1-63 letters, digits, '-', '_' or
// '.', starting with a letter or digit.
func checkName(kind, name string) error {
	if name == "" || len(name) > 63 {
		return status.Errorf(codes.InvalidArgument, "%s.name: %q must be 1 to 63 characters", kind, name)
	}
	for i, r := range name {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || i > 0 && (r == '-' || r == '_' || r == '.')
		if !ok {
			return status.Errorf(codes.InvalidArgument, "%s.name: %q: letters, digits, '-', '_' or '.', starting with a letter or digit", kind, name)
		}
	}
	return nil
}

// errStopped ends a watch whose simulator is closing.
var errStopped = errors.New("simulator stopped")

func invalid(format string, args ...any) error {
	return status.Error(codes.InvalidArgument, fmt.Sprintf(format, args...))
}

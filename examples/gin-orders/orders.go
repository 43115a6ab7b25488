package main

import (
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/gin-gonic/gin"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// Order is the business row.
type Order struct {
	ID        uint64    `gorm:"primaryKey" json:"id"`
	Customer  string    `gorm:"size:128;not null" json:"customer"`
	Total     int64     `gorm:"not null" json:"total"`
	Status    string    `gorm:"size:32;not null" json:"status"`
	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

// The events the service publishes to Kafka, one JSON object per record,
// keyed by the order id so every event of one order keeps its order.
type (
	OrderPlaced struct {
		Type     string `json:"type"`
		OrderID  uint64 `json:"order_id"`
		Customer string `json:"customer"`
		Total    int64  `json:"total"`
		Status   string `json:"status"`
	}
	OrderStatusChanged struct {
		Type    string `json:"type"`
		OrderID uint64 `json:"order_id"`
		From    string `json:"from"`
		To      string `json:"to"`
	}
	OrderCancelled struct {
		Type    string `json:"type"`
		OrderID uint64 `json:"order_id"`
	}
)

func orderKey(id uint64) []byte { return []byte(strconv.FormatUint(id, 10)) }

func eventType(t string) outbox.Header { return outbox.Header{Key: "event-type", Value: []byte(t)} }

// orderRules are the declarative publish rules: each runs inside the
// transaction of the write that triggers it.
func orderRules(topic string) []outbox.Rule {
	return []outbox.Rule{
		outbox.OnCreate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			o := c.Entity
			return outbox.JSONMessage(topic, orderKey(o.ID),
				OrderPlaced{Type: "OrderPlaced", OrderID: o.ID, Customer: o.Customer, Total: o.Total, Status: o.Status},
				eventType("OrderPlaced"))
		}),
		outbox.OnUpdate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			if !c.HasChanged("status") || c.Before == nil || c.Before.Status == c.Entity.Status {
				return nil, nil // only a real status change is an event
			}
			return outbox.JSONMessage(topic, orderKey(c.Entity.ID),
				OrderStatusChanged{Type: "OrderStatusChanged", OrderID: c.Entity.ID, From: c.Before.Status, To: c.Entity.Status},
				eventType("OrderStatusChanged"))
		}),
		outbox.OnDelete(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			return outbox.JSONMessage(topic, orderKey(c.Entity.ID),
				OrderCancelled{Type: "OrderCancelled", OrderID: c.Entity.ID},
				eventType("OrderCancelled"))
		}),
	}
}

var validStatus = map[string]bool{"new": true, "paid": true, "shipped": true, "delivered": true}

type orderHandlers struct{ db *gorm.DB }

func (h orderHandlers) routes(r gin.IRouter) {
	r.POST("/orders", h.create)
	r.GET("/orders/:id", h.get)
	r.PATCH("/orders/:id", h.patch)
	r.DELETE("/orders/:id", h.delete)
}

func (h orderHandlers) create(c *gin.Context) {
	var in struct {
		Customer string `json:"customer" binding:"required"`
		Total    int64  `json:"total" binding:"gte=0"`
	}
	if err := c.ShouldBindJSON(&in); err != nil {
		c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()})
		return
	}
	o := Order{Customer: in.Customer, Total: in.Total, Status: "new"}
	// One implicit transaction: the order row and its OrderPlaced message.
	if err := h.db.WithContext(c.Request.Context()).Create(&o).Error; err != nil {
		c.JSON(http.StatusInternalServerError, gin.H{"error": err.Error()})
		return
	}
	c.JSON(http.StatusCreated, o)
}

func (h orderHandlers) load(c *gin.Context) (*Order, bool) {
	id, err := strconv.ParseUint(c.Param("id"), 10, 64)
	if err != nil {
		c.JSON(http.StatusBadRequest, gin.H{"error": "invalid order id"})
		return nil, false
	}
	var o Order
	if err := h.db.WithContext(c.Request.Context()).First(&o, id).Error; err != nil {
		if errors.Is(err, gorm.ErrRecordNotFound) {
			c.JSON(http.StatusNotFound, gin.H{"error": "order not found"})
		} else {
			c.JSON(http.StatusInternalServerError, gin.H{"error": err.Error()})
		}
		return nil, false
	}
	return &o, true
}

func (h orderHandlers) get(c *gin.Context) {
	if o, ok := h.load(c); ok {
		c.JSON(http.StatusOK, o)
	}
}

func (h orderHandlers) patch(c *gin.Context) {
	var in struct {
		Status string `json:"status" binding:"required"`
	}
	if err := c.ShouldBindJSON(&in); err != nil {
		c.JSON(http.StatusBadRequest, gin.H{"error": err.Error()})
		return
	}
	if !validStatus[in.Status] {
		c.JSON(http.StatusBadRequest, gin.H{"error": "status must be one of new, paid, shipped, delivered"})
		return
	}
	o, ok := h.load(c)
	if !ok {
		return
	}
	// Update on the loaded order: the rule sees the old status in Before.
	if err := h.db.WithContext(c.Request.Context()).Model(o).Update("status", in.Status).Error; err != nil {
		c.JSON(http.StatusInternalServerError, gin.H{"error": err.Error()})
		return
	}
	c.JSON(http.StatusOK, o)
}

func (h orderHandlers) delete(c *gin.Context) {
	o, ok := h.load(c)
	if !ok {
		return
	}
	if err := h.db.WithContext(c.Request.Context()).Delete(o).Error; err != nil {
		c.JSON(http.StatusInternalServerError, gin.H{"error": err.Error()})
		return
	}
	c.Status(http.StatusNoContent)
}
